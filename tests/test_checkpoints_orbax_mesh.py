"""A training checkpoint saved on one mesh restores onto another and onto one device (docs/method.md §5)."""

import textwrap

import numpy as np
import pytest
from helpers.fake_devices import run_json

# Runs in a subprocess: the device count must be set before JAX initialises.
_MOVE_MESH = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_default_matmul_precision", "highest")
    import numpy as np
    from flax import nnx
    import refusion_jax as rj
    from refusion_jax.checkpoints.load import load
    from refusion_jax.training import loop as train
    from refusion_jax.training.config_file import load_config

    root, seed = sys.argv[1], int(sys.argv[2])

    def run(workdir, mesh, **overrides):
      config = load_config("configs/demo.py", "smoke")
      config.data.data_dir = os.path.join(root, "data")
      # Four KV heads and a vocabulary of 260 split over tensor=4.
      config.model.update(num_heads=4, num_kv_heads=4, head_dim=8)
      config.update(seed=seed, eval_every=0, num_train_steps=4, log_every=100, **overrides)
      config.mesh.update({"data": 1, "fsdp": 1, "tensor": 1, **mesh})
      return train.train_and_evaluate(config, os.path.join(root, workdir)).losses

    moved = run("moved", {"data": 8}, stop_after_step=2)  # saved at step 2 on data=8
    moved.update(run("moved", {"fsdp": 2, "tensor": 4}))  # resumed on fsdp=2 x tensor=4
    straight = run("straight", {"data": 8})
    model, _ = load(os.path.join(root, "moved"))  # onto one device
    leaves = jax.tree.leaves(nnx.state(model))
    prompts = [[5, 6, 7], [8, 9]]
    method = rj.ReFusion(gen_length=8, slot_size=4, serial_blocks=1, slot_threshold=0.5, token_threshold=0.3)
    single = rj.decode(model, prompts, method)
    sharded = rj.decode(model, prompts, method, mesh=rj.make_mesh({"fsdp": 2, "tensor": 4}))
    print(json.dumps(dict(
        moved={int(k): v for k, v in moved.items()}, straight={int(k): v for k, v in straight.items()},
        single_device=all(len(x.sharding.device_set) == 1 for x in leaves),
        tokens=[single.tokens, sharded.tokens])))
""")


@pytest.mark.slow  # three short training runs on 8 fake devices (~95 s of CPU)
def test_checkpoint_moves_between_meshes(tmp_path):
  seed = int(np.random.default_rng().integers(1 << 16))
  report = run_json(_MOVE_MESH, str(tmp_path), str(seed), timeout=900)
  moved, straight = report["moved"], report["straight"]
  assert sorted(moved) == sorted(straight) == ["1", "2", "3", "4"]
  # Steps 3 and 4 ran on fsdp=2 x tensor=4 from the data=8 checkpoint: same losses as never moving.
  np.testing.assert_allclose([moved[k] for k in "1234"], [straight[k] for k in "1234"], rtol=1e-5, atol=1e-5)
  assert report["single_device"]
  single, sharded = report["tokens"]
  assert single == sharded
