"""ReFusion in JAX: slot-parallel plan-and-infill decoding on a causal transformer.

Public names are imported lazily so that `import refusion_jax` stays cheap and
a notebook only pays for what it uses (torch-free, tfds-free sampling). Everything
else — the eager reference decoder, the KV cache, the training internals — is
reached by its module path (see the module map in README.md).
"""

import importlib

_EXPORTS = {
  # Models and their configs.
  "ModelConfig": "refusion_jax.model.config",
  "preset": "refusion_jax.model.config",
  "Transformer": "refusion_jax.model.transformer",
  "init_model": "refusion_jax.model.transformer",
  # Checkpoints and tokenizers: `load` (model and tokenizer) and `load_model` are the front door for every source.
  "load": "refusion_jax.checkpoints.load",
  "load_model": "refusion_jax.checkpoints.load",
  "inspect_checkpoint": "refusion_jax.checkpoints.load",
  "save_hf": "refusion_jax.checkpoints.hf",
  "load_tokenizer": "refusion_jax.data.tokenizer",
  # LoRA: adapters on a model, merged into it, and peft's adapter files both ways.
  "LoraConfig": "refusion_jax.model.lora",
  "add_lora": "refusion_jax.model.lora",
  "merge_lora": "refusion_jax.model.lora",
  "save_lora": "refusion_jax.checkpoints.peft",
  "load_lora": "refusion_jax.checkpoints.peft",
  # Decoding.
  "generate": "refusion_jax.decoding.refusion",
  "ar_generate": "refusion_jax.decoding.ar",
  "mdm_generate": "refusion_jax.decoding.mdm",
  "DecodeResult": "refusion_jax.decoding.result",
  "Sampler": "refusion_jax.decoding.sampler",
  # Scale-out.
  "make_mesh": "refusion_jax.parallel.sharding",
}

# Names of earlier versions -> what replaced them (asking for one says so).
_RENAMED = {
  "load_checkpoint": "load_model(path, ...) (same arguments)",
  "load_hf": 'load_model(path, format="hf", dtype=..., config=...) (config replaces config_overrides)',
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  if name in _RENAMED:
    raise AttributeError(f"refusion_jax.{name} was renamed: use refusion_jax.{_RENAMED[name]}.")
  raise AttributeError(f"module 'refusion_jax' has no attribute {name!r}")
