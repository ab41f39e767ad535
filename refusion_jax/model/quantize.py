"""Quantizing a whole model's projections, and dequantizing them back (refusion_jax.model.quant).

    model = quantize(load_model("/ckpt/ReFusion"), "int8")   # int8 q/k/v/o and gate/up/down kernels
    model = quantize(model_fp, "int4", group_size=128)        # int4, one scale per 128 inputs
    float_model = dequantize(model, "bfloat16")               # for export, or to merge LoRA adapters

Loading a checkpoint with `load_model(path, quantize="int8")` quantizes while
reading, one array at a time (refusion_jax.checkpoints.restore), so the float model
never sits on the device whole; `quantize` is for a model already in hand.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from refusion_jax.model import quant
from refusion_jax.model.adapter import TARGETS, split_adapters
from refusion_jax.model.transformer import Transformer, with_config


def is_quantized(model: Transformer) -> bool:
  """Whether `model`'s projections hold integer kernels."""
  return model.config.quantize != "none"


def _projections(model: Transformer):
  """(parent module, kernel name, input axes) of every projection of every layer."""
  for layer in model.layers:
    for kernel, (parent_name, inputs) in TARGETS.items():
      yield getattr(layer, parent_name), kernel, inputs


def _scale_sharding(weight: jax.Array, inputs: int):
  """Where a kernel's scale [groups, *out] goes: the kernel's output axes' placement, groups replicated."""
  placement = getattr(weight, "sharding", None)
  if not isinstance(placement, NamedSharding):
    return placement
  spec = tuple(placement.spec) + (None,) * (weight.ndim - len(placement.spec))
  return NamedSharding(placement.mesh, PartitionSpec(None, *spec[inputs:]))


def quantize(model: Transformer, mode: str, group_size: int = 128) -> Transformer:
  """`model` with int8 or int4 projection kernels (one projection at a time; `model` is left as it is).

  Args:
    mode: "int8" (per output channel) or "int4" (per output channel and group of inputs).
    group_size: int4 inputs per scale (0: per output channel); must divide every projection's input width.

  Raises:
    ValueError: an unknown mode, a group size that does not divide the input widths, a model already
      quantized or carrying LoRA adapters, int4 on a backend that cannot contract it.
  """
  quant.check_mode(mode)
  if mode == "none":
    raise ValueError("quantize(model, 'none') changes nothing: use dequantize(model) for float kernels.")
  if is_quantized(model):
    raise ValueError(
      f"The model is already quantized ({model.config.quantize}): quantize the float model (load it without "
      "quantize=), or dequantize(model) first."
    )
  if jax.tree.leaves(split_adapters(nnx.state(model))[0]):
    raise ValueError("The model carries LoRA adapters: quantize the base first, then add_lora (QLoRA).")
  config = model.config.replace(quantize=mode, quantize_group_size=group_size)  # checks the group size
  quant.check_backend(mode)
  graphdef, state = nnx.split(model)
  quantized = nnx.merge(graphdef, state)  # a new module tree over the same arrays
  convert = jax.jit(quant.quantize_kernel, static_argnums=(1, 2, 3))
  for parent, kernel, inputs in _projections(quantized):
    weight = getattr(parent, kernel)
    q, scale = convert(weight[...], inputs, mode, group_size)
    q = jax.device_put(q, getattr(weight[...], "sharding", None))
    scale = jax.device_put(scale, _scale_sharding(weight[...], inputs))
    setattr(parent, kernel + quant.SCALE_SUFFIX, quant.scale_param(scale, weight, inputs))
    setattr(parent, kernel, weight.replace(q))
  return with_config(quantized, config)


def dequantize(model: Transformer, dtype: str | None = None) -> Transformer:
  """`model` with float projection kernels again (q · scale), in `dtype` (default: the config's
  `param_dtype`); LoRA adapters stay as they are. A float model is returned as it is."""
  if not is_quantized(model):
    return model
  config = model.config.replace(quantize="none", **({} if dtype is None else dict(param_dtype=dtype)))
  graphdef, state = nnx.split(model)
  restored = nnx.merge(graphdef, state)
  convert = jax.jit(quant.dequantize_kernel, static_argnums=(2, 3))
  for parent, kernel, inputs in _projections(restored):
    weight = getattr(parent, kernel)
    scale = getattr(parent, kernel + quant.SCALE_SUFFIX)
    value = convert(weight[...], scale[...], inputs, config.weight_dtype)
    setattr(parent, kernel, weight.replace(jax.device_put(value, getattr(weight[...], "sharding", None))))
    delattr(parent, kernel + quant.SCALE_SUFFIX)
  return with_config(restored, config)
