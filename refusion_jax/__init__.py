"""ReFusion in JAX: slot-parallel plan-and-infill decoding on a causal transformer.

Public names are imported lazily so that `import refusion_jax` stays cheap and
a notebook only pays for what it uses (torch-free, tfds-free sampling).
"""

import importlib

_EXPORTS = {
  "ModelConfig": "refusion_jax.model.config",
  "preset": "refusion_jax.model.config",
  "Transformer": "refusion_jax.model.transformer",
  "init_model": "refusion_jax.model.transformer",
  "KVCache": "refusion_jax.model.cache",
  "BlockKV": "refusion_jax.model.cache",
  "load_checkpoint": "refusion_jax.checkpoints.load",
  "inspect_checkpoint": "refusion_jax.checkpoints.load",
  "load": "refusion_jax.checkpoints.load",
  "load_hf": "refusion_jax.checkpoints.hf",
  "save_hf": "refusion_jax.checkpoints.hf",
  "generate": "refusion_jax.decoding.refusion",
  "DecodeResult": "refusion_jax.decoding.refusion",
  "decode_reference": "refusion_jax.decoding.reference",
  "ar_generate": "refusion_jax.decoding.baselines",
  "mdm_generate": "refusion_jax.decoding.baselines",
  "Sampler": "refusion_jax.decoding.sampler",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'refusion_jax' has no attribute {name!r}")
