"""LoRA on a whole model: adapters added to every targeted projection, merged back, the abstract LoRA model.

The adapter itself (its config, its weights, its contribution to a projection)
is `refusion_jax.model.adapter`, below the transformer; this module works on a
`Transformer` and re-exports the adapter's names, so `lora.LoraConfig` and the
others read as before (docs/architecture.md, "LoRA").

    model = add_lora(base_model, LoraConfig(rank=8, alpha=16))   # B = 0: same logits as base_model
    merged = merge_lora(model)                                    # W + scale·A·B, adapters gone

A quantized base (QLoRA, refusion_jax.model.quant) keeps its integer kernels
frozen under float32 adapters; merging dequantizes it first, and only when
asked (`merge_lora(model, dequantize=True)`): the merged kernels are float.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from refusion_jax.model import quantize as quantize_lib
from refusion_jax.model.adapter import (
  ADAPTER_WEIGHTS,
  DEFAULT_TARGETS,
  SUFFIX,
  TARGETS,
  LoraAdapter,
  LoraConfig,
  delta,
  is_adapter,
  split_adapters,
  trainable_part,
)
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer

__all__ = [
  "ADAPTER_WEIGHTS",
  "DEFAULT_TARGETS",
  "SUFFIX",
  "TARGETS",
  "LoraAdapter",
  "LoraConfig",
  "abstract_lora_model",
  "adapted_kernels",
  "add_lora",
  "delta",
  "dropout_key",
  "is_adapter",
  "lora_config_of",
  "merge_lora",
  "merged_weight",
  "split_adapters",
  "trainable_part",
]

# Where a training step's dropout key for the adapters comes from: fold_in(step key, this), a stream no other
# draw of the step uses.
_DROPOUT_STREAM = 0x10A


def adapted_kernels(model: Transformer) -> Iterator[tuple[int, str, nnx.Module, LoraAdapter]]:
  """(layer index, kernel name, parent module, adapter) of every adapter of `model`, in layer order."""
  for i, layer in enumerate(model.layers):
    for kernel, (parent_name, _) in TARGETS.items():
      parent = getattr(layer, parent_name)
      adapter = getattr(parent, kernel + SUFFIX, None)
      if adapter is not None:
        yield i, kernel, parent, adapter


def lora_config_of(model: Transformer) -> LoraConfig:
  """The `LoraConfig` of the adapters `model` carries (rank 0 when it carries none)."""
  found = list(adapted_kernels(model))
  if not found:
    return LoraConfig()
  return found[0][3].lora


def add_lora(model: Transformer, lora: LoraConfig, seed: int = 0) -> Transformer:
  """`model` with an adapter on every targeted kernel of every layer (B = 0: the function is unchanged).

  The model is changed in place and returned. A model that already carries
  adapters is refused (merge them first, `merge_lora`).
  """
  if not lora.enabled:
    return model
  if any(True for _ in adapted_kernels(model)):
    raise ValueError("The model already carries LoRA adapters: merge them first (merge_lora) to add new ones.")
  key = jax.random.PRNGKey(seed)
  for i, layer in enumerate(model.layers):
    for kernel in lora.targets:
      parent_name, inputs = TARGETS[kernel]
      parent = getattr(layer, parent_name)
      weight = getattr(parent, kernel)
      axes = weight.get_metadata().get("out_sharding") or (None,) * weight.ndim
      adapter = LoraAdapter(
        weight.shape[:inputs],
        weight.shape[inputs:],
        axes[:inputs],
        axes[inputs:],
        lora,
        jax.random.fold_in(key, i * len(TARGETS) + list(TARGETS).index(kernel)),
      )
      setattr(parent, kernel + SUFFIX, adapter)
  return model


def merged_weight(weight: jax.Array, adapter: LoraAdapter) -> jax.Array:
  """W + scale · A·B [*in, *out], in W's dtype (the sum taken in float32)."""
  a, b = adapter.lora_a[...], adapter.lora_b[...]
  update = jnp.tensordot(a, b, axes=1) * adapter.lora.scale
  return (weight.astype(jnp.float32) + update).astype(weight.dtype)


def merge_lora(model: Transformer, dequantize: bool = False) -> Transformer:
  """A model without adapters whose kernels are W + scale·A·B: the same function, no extra contractions.

  `model` itself is left as it is; the result shares its other parameters.

  Args:
    dequantize: for a quantized base (QLoRA), merge into its dequantized kernels (in the config's
      `param_dtype`): the result is a float model. Without it adapters on a quantized base are refused,
      since W + scale·A·B is no longer on the integer grid (a quantized model without adapters is
      returned quantized).
  """
  if model.config.quantize != "none" and (dequantize or any(True for _ in adapted_kernels(model))):
    if not dequantize:
      raise ValueError(
        f"The base is quantized ({model.config.quantize}): adapters merge only into float kernels. Use "
        "merge_lora(model, dequantize=True) for a float model (e.g. to export), or keep the adapters unmerged."
      )
    model = quantize_lib.dequantize(model)
  graphdef, state = nnx.split(model)
  merged = nnx.merge(graphdef, state)  # a new module tree over the same arrays
  for _, kernel, parent, adapter in adapted_kernels(merged):
    weight = getattr(parent, kernel)
    setattr(parent, kernel, weight.replace(merged_weight(weight[...], adapter)))
    delattr(parent, kernel + SUFFIX)
  return merged


def dropout_key(model: Transformer, key: jax.Array) -> jax.Array | None:
  """The adapters' dropout key of a training step whose key is `key`; None when no adapter drops out."""
  config = lora_config_of(model)
  return jax.random.fold_in(key, _DROPOUT_STREAM) if config.enabled and config.dropout > 0 else None


def abstract_lora_model(model_config: ModelConfig, lora: LoraConfig) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, state) of a model with adapters, every parameter a `jax.ShapeDtypeStruct`; nothing allocated."""
  return nnx.split(nnx.eval_shape(lambda: add_lora(Transformer(model_config, rngs=nnx.Rngs(0)), lora)))
