"""ReFusion in JAX: slot-parallel plan-and-infill decoding on a causal transformer.

Public names are imported lazily so that `import refusion_jax` stays cheap and
a notebook only pays for what it uses (torch-free, tfds-free sampling). Everything
else — the eager reference decoder, the KV cache, the training internals — is
reached by its module path (see the module map in docs/modules.md).
"""

import importlib

from refusion_jax.versions import __version__ as __version__  # the one place the version is said
from refusion_jax.versions import check_jax

check_jax()  # a jax outside the window is named here, not deep in a kernel
del check_jax

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
  "LoraConfig": "refusion_jax.model.adapter",
  "add_lora": "refusion_jax.model.lora",
  "merge_lora": "refusion_jax.model.lora",
  "save_lora": "refusion_jax.checkpoints.peft",
  # Weight-only int8 / int4 projections (QLoRA: a quantized base under LoRA adapters).
  "quantize": "refusion_jax.model.quantize",
  "dequantize": "refusion_jax.model.quantize",
  "load_lora": "refusion_jax.checkpoints.peft",
  # Decoding: a method value, one call (or a Sampler for text, an Engine to feed prompt by prompt).
  "ReFusion": "refusion_jax.decoding.refusion",
  "AR": "refusion_jax.decoding.ar",
  "MDM": "refusion_jax.decoding.mdm",
  "PAPER_TASKS": "refusion_jax.decoding.paper",
  "paper_method": "refusion_jax.decoding.paper",
  "decode": "refusion_jax.decoding.engine",
  "Engine": "refusion_jax.decoding.engine",
  "DecodeOptions": "refusion_jax.decoding.options",
  "register_method": "refusion_jax.decoding.methods",
  "compile_count": "refusion_jax.decoding.loop",
  "clear_caches": "refusion_jax.decoding.programs",
  "DecodeResult": "refusion_jax.decoding.result",
  "Sampler": "refusion_jax.decoding.sampler",
  # Scale-out.
  "make_mesh": "refusion_jax.parallel.sharding",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
