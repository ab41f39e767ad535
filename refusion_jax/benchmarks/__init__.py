"""What `python -m refusion_jax.bench` and `python -m refusion_jax.train_bench` run: one module per benchmark, typed
options in and rows out, each formatting its own table, all timed by `timer` (docs/modules.md)."""
