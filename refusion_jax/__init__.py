"""ReFusion in JAX: slot-parallel plan-and-infill decoding on a causal transformer.

Public names are imported lazily so that `import refusion_jax` stays cheap and
a notebook only pays for what it uses (torch-free, tfds-free sampling).
"""

import importlib

_EXPORTS = {
    "ModelConfig": "refusion_jax.config",
    "preset": "refusion_jax.config",
    "Transformer": "refusion_jax.model",
    "init_model": "refusion_jax.model",
    "KVCache": "refusion_jax.cache",
    "BlockKV": "refusion_jax.cache",
    "load_hf": "refusion_jax.hf_io",
    "save_hf": "refusion_jax.hf_io",
    "generate": "refusion_jax.decode",
    "DecodeResult": "refusion_jax.decode",
    "decode_reference": "refusion_jax.decode_reference",
    "ar_generate": "refusion_jax.baselines",
    "mdm_generate": "refusion_jax.baselines",
    "Sampler": "refusion_jax.sampler",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'refusion_jax' has no attribute {name!r}")
