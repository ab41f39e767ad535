"""Weight-only int8 / int4 projections: the integer kernel, its scales, and the contraction that reads them.

A quantized projection keeps its kernel `W` [*in, *out] as integers `q` of the same
shape and a float32 scale per output channel and input group, `scale` [groups, *out]:
`W ≈ q · scale`, the input axes (flattened) cut into `groups` equal runs. int8 uses one
group (per output channel); int4 (`jnp.int4`) groups of `quantize_group_size` inputs
(128 by default, 0: per output channel). Symmetric, round to nearest: `scale = max|W| / qmax`
over the group (127 for int8, 7 for int4), so `q` never clips.

The scale multiplies the contraction's *output*, `einsum(x, q.astype(x.dtype)) * scale`
(per group: each group contracts, is scaled, and the groups are summed), so XLA contracts
the integer kernel directly and no float copy of the weight is written (docs/architecture.md,
"Quantized weights"). For a block of many tokens against many groups, the per-group outputs
[tokens, groups, *out] would outgrow the weight itself; the kernel is then dequantized first
(one float copy of one projection), whichever temporary is smaller.

Kernels and scales are ordinary `nnx.Param`s (`q_proj` int, `q_proj_scale` float32) with
logical axes: the kernel keeps its axes, the scale carries `quant_groups` (replicated) then
the kernel's output axes. So sharding rules, `scan_layers`, every remat policy, LoRA
adapters (refusion_jax.model.adapter) and `nnx.split` / `merge` see parameters as always.
Activations, the attention scores and the logits are computed as for a float model.

Whole-model operations (`quantize`, `dequantize` a `Transformer`) are
`refusion_jax.model.quantize`, above the transformer.
"""

from __future__ import annotations

import functools
import math
import string

import jax
import jax.numpy as jnp
from flax import nnx

# `ModelConfig.quantize` values; "none" keeps float kernels.
MODES = ("none", "int8", "int4")
_INTEGER_DTYPES = {"int8": jnp.int8, "int4": jnp.int4}
_QMAX = {"int8": 127, "int4": 7}
# Scale attribute = kernel attribute + this suffix.
SCALE_SUFFIX = "_scale"
# The logical axis of a scale's input groups (refusion_jax.parallel.sharding: replicated).
GROUPS_AXIS = "quant_groups"


def check_mode(mode: str) -> None:
  """Refuse an unknown quantization mode, naming the known ones."""
  if mode not in MODES:
    raise ValueError(f"quantize={mode!r} is not a quantization mode; use one of {MODES}.")


def integer_dtype(mode: str) -> jnp.dtype:
  """The kernel dtype of `mode` ("int8" or "int4")."""
  return jnp.dtype(_INTEGER_DTYPES[mode])


def groups_of(mode: str, group_size: int, input_width: int) -> int:
  """How many input groups a kernel with `input_width` inputs has under `mode` (1: per output channel)."""
  if mode == "int8" or group_size == 0:
    return 1
  return input_width // group_size


def stored_bytes(shape: tuple[int, ...], dtype: jnp.dtype) -> int:
  """Bytes of an array as a device stores it: int4 packs two to a byte (numpy's `itemsize` says one)."""
  return -(-math.prod(shape) * jax.dtypes.itemsize_bits(dtype) // 8)


def check_group_size(mode: str, group_size: int, input_widths: dict[str, int]) -> None:
  """Refuse a group size that is negative or does not divide every projection's input width (named).

  Args:
    input_widths: a description of each input width (e.g. "hidden_size") -> its size.
  """
  if group_size < 0:
    raise ValueError(f"quantize_group_size={group_size} must be >= 0 (0: one scale per output channel).")
  if mode != "int4" or group_size == 0:
    return
  bad = {name: width for name, width in input_widths.items() if width % group_size}
  if bad:
    sizes = sorted(set(input_widths.values()))
    common = math.gcd(*sizes)
    raise ValueError(
      f"quantize_group_size={group_size} does not divide the input width of every projection "
      f"({', '.join(f'{name} = {width}' for name, width in bad.items())}): use a divisor of {common} "
      f"(e.g. {common if common < 128 else 128}), or 0 for one scale per output channel."
    )


@functools.cache
def _contracts_int4(platform: str) -> bool:
  """Whether the `platform` backend compiles an int4 kernel contraction (a few-element probe, compiled once)."""
  try:
    probe = jax.jit(lambda x, w: x @ w.astype(x.dtype), backend=platform)
    probe.lower(jax.ShapeDtypeStruct((1, 8), jnp.bfloat16), jax.ShapeDtypeStruct((8, 8), jnp.int4)).compile()
  except Exception:  # noqa: BLE001 - any refusal of the backend means "no int4 here"
    return False
  return True


def check_backend(mode: str, platform: str | None = None) -> None:
  """Refuse int4 on a backend that cannot contract int4 kernels (before the model compiles), naming int8.

  Args:
    platform: the backend to check (default: jax's default backend).
  """
  platform = platform or jax.default_backend()
  if mode == "int4" and not _contracts_int4(platform):
    raise ValueError(
      f"int4 weights need a backend that contracts int4 kernels, and {platform} does not compile one: "
      "use quantize='int8' (half the memory of bfloat16 instead of a quarter)."
    )


def quantize_kernel(weight: jax.Array, inputs: int, mode: str, group_size: int) -> tuple[jax.Array, jax.Array]:
  """(integer kernel, scale) of a float kernel.

  Args:
    weight: [*in, *out] float, its first `inputs` axes the contraction's.
    mode: "int8" or "int4".
    group_size: int4 inputs per group (0: per output channel); int8 is always per output channel.

  Returns:
    q [*in, *out] in `integer_dtype(mode)`, and scale [groups, *out] float32.
  """
  in_shape, out_shape = weight.shape[:inputs], weight.shape[inputs:]
  width = math.prod(in_shape)
  groups = groups_of(mode, group_size, width)
  grouped = weight.astype(jnp.float32).reshape(groups, width // groups, *out_shape)
  qmax = _QMAX[mode]
  scale = jnp.max(jnp.abs(grouped), axis=1) / qmax
  scale = jnp.where(scale > 0, scale, 1.0)  # an all-zero group: any scale reproduces it
  q = jnp.clip(jnp.round(grouped / scale[:, None]), -qmax, qmax)
  return q.reshape(weight.shape).astype(integer_dtype(mode)), scale


def dequantize_kernel(q: jax.Array, scale: jax.Array, inputs: int, dtype: jnp.dtype) -> jax.Array:
  """The float kernel [*in, *out] in `dtype` that `q` [*in, *out] and `scale` [groups, *out] stand for."""
  in_shape, out_shape = q.shape[:inputs], q.shape[inputs:]
  groups = scale.shape[0]
  grouped = q.astype(jnp.float32).reshape(groups, math.prod(in_shape) // groups, *out_shape)
  return (grouped * scale[:, None]).reshape(q.shape).astype(dtype)


def scale_param(scale: jax.Array, kernel: nnx.Param, inputs: int) -> nnx.Param:
  """The scale [groups, *out] as a parameter beside `kernel`: `quant_groups`, then the kernel's output axes."""
  axes = kernel.get_metadata().get("out_sharding") or (None,) * kernel.ndim
  return nnx.Param(scale, out_sharding=(GROUPS_AXIS, *axes[inputs:]), eager_sharding=False)


def project(module: nnx.Module, kernel: str, x: jax.Array, inputs: int) -> jax.Array:
  """x [batch, length, *in] · `module.<kernel>` [*in, *out] -> [batch, length, *out] in x's dtype.

  A float kernel is cast to x's dtype and contracted; an integer one (with `module.<kernel>_scale`)
  is contracted as integers and scaled on the output.
  """
  weight = getattr(module, kernel)[...]
  batch_axes = x.ndim - inputs
  scale = getattr(module, kernel + SCALE_SUFFIX, None)
  if scale is None:
    return jnp.tensordot(x, weight.astype(x.dtype), axes=inputs)
  scale = scale[...]
  groups = scale.shape[0]
  out_shape = weight.shape[inputs:]
  if groups == 1:
    return jnp.tensordot(x, weight.astype(x.dtype), axes=inputs) * scale[0].astype(x.dtype)
  width = math.prod(weight.shape[:inputs])
  tokens = math.prod(x.shape[:batch_axes])
  if tokens * groups > width:  # the per-group outputs would outgrow one float copy of the kernel
    return jnp.tensordot(x, dequantize_kernel(weight, scale, inputs, x.dtype), axes=inputs)
  letters = string.ascii_lowercase
  lead, outs = letters[:batch_axes], letters[batch_axes : batch_axes + len(out_shape)]
  spec = f"{lead}yz,yz{outs}->{lead}y{outs}"  # y: the group, z: an input within it

  def contract(grouped_x: jax.Array, grouped_w: jax.Array) -> jax.Array:
    return jnp.einsum(spec, grouped_x, grouped_w, preferred_element_type=jnp.float32)

  def contract_in_float32(grouped_x: jax.Array, grouped_w: jax.Array) -> jax.Array:
    return contract(grouped_x.astype(jnp.float32), grouped_w.astype(jnp.float32))

  # XLA:CPU (jax 0.10) has no batched bfloat16 dot into float32 ("Unsupported element type for DotThunk"); it
  # casts a dot's operands to float32 anyway, so there both are cast first: the same sums. The platform is the
  # one compiled for, so an accelerator (or an AOT compile for one on a CPU host) contracts the narrow operands.
  per_group = jax.lax.platform_dependent(
    x.reshape(*x.shape[:batch_axes], groups, width // groups),
    weight.reshape(groups, width // groups, *out_shape).astype(x.dtype),
    cpu=contract_in_float32,
    default=contract,
  )
  return jnp.sum(per_group * scale, axis=batch_axes).astype(x.dtype)
