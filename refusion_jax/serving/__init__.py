"""An OpenAI-compatible HTTP server over the continuous-batching decoder (`python -m refusion_jax.serve`).

FastAPI and uvicorn come with the `serve` extra; `refusion_jax.serving.app`
imports them, the engine and the request checks do not (docs/serving.md).
"""
