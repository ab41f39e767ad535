"""Fused attention for training forwards: causal (or full) attention within packed segments, no [B, T, T] mask.

A training forward describes its attention by segment ids (docs/method.md §1:
plain causal attention over the stored order, never across examples packed
into one row), which is exactly what flash kernels implement. They walk the
keys block by block with a running softmax, so neither the scores nor a mask
of the whole row ever exist:

| target | kernel                                                       | adapted here                             |
| ------ | ------------------------------------------------------------ | ---------------------------------------- |
| TPU    | splash attention (`jax.experimental.pallas.ops.tpu`), GQA    | length padded to 128s                    |
| GPU    | Pallas Triton flash attention (`...pallas.ops.gpu`), no GQA  | length padded to 128s; KV heads repeated |
| GPU    | tokamax's Pallas Triton flash attention, GQA, key ranges     | segment ids become each query's key range |
| CPU    | splash attention interpreted (`interpret=True`)              | as TPU; a slow reference, for tests      |

On a GPU, jax's own Triton kernel runs where the installed jax ships it
(up to jax 0.12.0; 0.12.1 dropped `pallas/ops/gpu/attention.py`), else
tokamax's (Google's maintained Pallas kernel library, installed with the
`cuda12` / `cuda13` extras on Python >= 3.12), else the dense path, which
`auto` then says once in the log. The other GPU attentions of jax 0.12 do not
fit a training forward: `jax.nn.dot_product_attention(implementation="cudnn")`
takes per-row lengths and a sliding window but no segment ids (the packed
segments cuDNN supports are reachable only through the private
`jax._src.cudnn`), and the Mosaic GPU kernel
(`pallas/ops/gpu/attention_mgpu.py`, Hopper and later) takes no mask at all,
has no causal backward pass and runs only float16 / bfloat16 with head_dim a
multiple of 64. tokamax masks by key ranges rather than ids: each query sees
the keys from the start of its segment (to its own position, or to the
segment's end when bidirectional), which is the segment mask because packing
writes every example, and the padding, as one run of equal ids
(docs/method.md §1).

Shape constraints, met here (never an error): the length must be a multiple
of the kernels' blocks (splash: 512, 256 or 128, whichever divides it; the
Triton kernels: 128 at most), so it is padded to a multiple of
128, the added positions forming a segment of their own that no real token
sees. head_dim: splash takes any (it compiles for v5p at 16, 64 and 128);
the Triton kernels pad it to a power of two themselves. Segment id 0 (padding)
is a segment like any other: padding sees only padding, as the dense mask says.

All kernels are modules of jax or tokamax imported when first used; where the
installed packages lack the platform's kernel, `auto` keeps the dense path and
`flash` says so.

Under `activation_sharding` (a mesh) a Pallas kernel cannot be split by XLA's
partitioner, so it runs inside `shard_map`: each device attends its own rows
(the batch axes) and, when the tensor axis divides the KV heads, its own
heads. The length is never split (a query block needs every key block).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import unittest.mock

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from refusion_jax.parallel.activations import active_layout, active_mesh

logger = logging.getLogger(__name__)

# The kernels' block granularity along the length.
LENGTH_MULTIPLE = 128
_SPLASH_BLOCKS = (512, 256, 128)
# Segment id of the positions added to reach LENGTH_MULTIPLE (real ids are >= 0).
_PAD_SEGMENT = -1
# Where each kernel lives. Imported when used: they are experimental modules that jax may move (it removed the
# Triton one in 0.12.1), and a model that never runs them must not depend on them. tokamax's attention is read
# from its module rather than `tokamax.ops.gpu`, which also imports its other GPU kernels and with them
# jax_triton; setup.py pins the tokamax release this path was tested with.
_KERNEL_MODULES = {
  "splash": "jax.experimental.pallas.ops.tpu.splash_attention",
  "triton": "jax.experimental.pallas.ops.gpu.attention",
  "tokamax": "tokamax._src.ops.attention.pallas_triton",
}
# A GPU's kernels, the first the installed packages have is used: jax's own where it still ships it (the kernel
# this project trained with before jax 0.12.1), tokamax's after.
GPU_KERNELS = ("triton", "tokamax")
KERNELS = ("splash", *GPU_KERNELS)


@flax.struct.dataclass
class Segments:
  """The attention of a training forward, given by segment ids instead of a mask.

  Attributes:
    ids: [batch, length] int; a token attends to the tokens of its own segment
      only (0 marks padding, which then sees only padding).
    bidirectional: every token of a segment (the MDM baseline), not only the
      earlier ones.
  """

  ids: jax.Array
  bidirectional: bool = flax.struct.field(pytree_node=False, default=False)


def target_platform() -> str:
  """ "tpu", "gpu" or "cpu": the devices of the mesh being traced for, else the default backend.

  Compiling for a TPU topology from a CPU host traces under that topology's
  mesh, so the kernel follows the compile target, not the host.
  """
  mesh = active_mesh()
  return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def kernel_for(platform: str) -> str:
  """The fused kernel of a platform: on GPU the first of `GPU_KERNELS` installed (the last when none is, so
  that `flash` names what to install), "splash" elsewhere (interpreted on CPU)."""
  if platform != "gpu":
    return "splash"
  return next((kernel for kernel in GPU_KERNELS if kernel_available(kernel)), GPU_KERNELS[-1])


def kernel_available(kernel: str) -> bool:
  """Whether the installed packages ship `kernel` (one of `KERNELS`)."""
  try:
    return importlib.util.find_spec(_KERNEL_MODULES[kernel]) is not None
  except ModuleNotFoundError:
    return False


def auto_uses_kernel(platform: str) -> bool:
  """Whether `attention_impl="auto"` fuses a training forward on `platform`: off the CPU (where the kernels
  only run interpreted) when the platform's kernel is installed. When it is not, says once in the log which
  path runs instead and why."""
  if platform == "cpu":
    return False
  kernel = kernel_for(platform)
  if not kernel_available(kernel):
    _say_once(
      f"attention_impl=auto on {platform}: training forwards take the dense path ([batch, length, length] "
      f"mask and scores): jax {jax.__version__} has no {_KERNEL_MODULES['triton']} and "
      f"{_KERNEL_MODULES[kernel]} is not installed; {_INSTALL_HINT}"
      if platform == "gpu"
      else f"attention_impl=auto on {platform}: training forwards take the dense path: jax {jax.__version__} "
      f"has no {_KERNEL_MODULES[kernel]}."
    )
    return False
  return True


_INSTALL_HINT = 'pip install -e ".[cuda13]" (or cuda12) on Python >= 3.12 brings tokamax for a fused kernel.'


@functools.cache
def _say_once(message: str) -> None:
  logger.warning(message)


def _kernel_module(kernel: str):
  if not kernel_available(kernel):
    raise ValueError(
      f"attention_impl='flash' needs {_KERNEL_MODULES[kernel]}, which is not installed (jax {jax.__version__}"
      f"{'; ' + _INSTALL_HINT if kernel in GPU_KERNELS else ''}); set --config.model.attention_impl=auto "
      "(the dense path where no kernel is installed) or chunked."
    )
  return importlib.import_module(_KERNEL_MODULES[kernel])


def attend_segments(q: jax.Array, k: jax.Array, v: jax.Array, segments: Segments) -> jax.Array:
  """Attention within segments by the fused kernel of the target platform.

  Args:
    q: [batch, length, kv_heads, groups, head_dim], already scaled by head_dim^-0.5.
    k, v: [batch, length, kv_heads, head_dim].
    segments: ids [batch, length].

  Returns:
    [batch, length, kv_heads, groups, head_dim] in q's dtype.
  """
  batch, length, kv_heads, groups, head_dim = q.shape
  platform = target_platform()
  kernel = kernel_for(platform)
  heads = q.reshape(batch, length, kv_heads * groups, head_dim)  # query head h uses KV head h // groups
  ids = segments.ids.astype(jnp.int32)
  pad = -length % LENGTH_MULTIPLE
  if pad:
    heads, k, v = (jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (heads, k, v))
    ids = jnp.pad(ids, [(0, 0), (0, pad)], constant_values=_PAD_SEGMENT)
  run = functools.partial(
    fused_attention, bidirectional=segments.bidirectional, kernel=kernel, interpret=platform == "cpu"
  )
  specs = _shard_specs(heads.shape, k.shape)
  if specs is not None:
    mesh, q_spec, kv_spec, ids_spec = specs
    run = jax.shard_map(
      run, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, ids_spec), out_specs=q_spec, check_vma=False
    )
  out = run(heads, k, v, ids)
  return out[:, :length].reshape(q.shape)


def _shard_specs(q_shape, kv_shape):
  """(mesh, q spec, k/v spec, ids spec) of the `shard_map` under an active mesh, else None.

  Rows follow the batch rules; heads follow the tensor rules only when both
  the query and the KV heads split the same way (else a device's query heads
  would lose their KV heads); length and head_dim stay whole.
  """
  q_layout = active_layout(("activation_batch", None, "activation_heads", None), q_shape)
  if q_layout is None:
    return None
  mesh, q_spec = q_layout
  _, kv_spec = active_layout(("activation_batch", None, "activation_kv_heads", None), kv_shape)
  if q_spec[2] != kv_spec[2]:
    q_spec = kv_spec = PartitionSpec(q_spec[0], None, None, None)
  return mesh, q_spec, kv_spec, PartitionSpec(q_spec[0], None)


def fused_attention(
  q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, bidirectional: bool, kernel: str, interpret: bool
) -> jax.Array:
  """One fused kernel on unsharded arrays.

  Args:
    q: [batch, length, heads, head_dim], already scaled; length a multiple of 128.
    k, v: [batch, length, kv_heads, head_dim]; kv_heads divides heads.
    segment_ids: [batch, length] int.
    bidirectional: full attention within a segment instead of causal.
    kernel: one of `KERNELS`: "splash" (TPU), "triton" or "tokamax" (GPU).
    interpret: run the Pallas kernel in the interpreter (any backend; slow).

  Returns:
    [batch, length, heads, head_dim] in q's dtype.
  """
  if q.shape[1] % LENGTH_MULTIPLE:
    raise ValueError(f"length {q.shape[1]} must be a multiple of {LENGTH_MULTIPLE}; attend_segments pads it.")
  if kernel == "splash":
    return _splash(q, k, v, segment_ids, bidirectional, interpret)
  if kernel == "triton":
    groups = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, groups, axis=2) for x in (k, v))
    mha = _kernel_module("triton").mha
    return mha(q, k, v, segment_ids, sm_scale=1.0, causal=not bidirectional, interpret=interpret).astype(q.dtype)
  if kernel == "tokamax":
    return _tokamax(q, k, v, segment_ids, bidirectional, interpret)
  raise ValueError(f"kernel={kernel!r}; expected one of {KERNELS}.")


def _splash(q, k, v, segment_ids, bidirectional: bool, interpret: bool) -> jax.Array:
  """Splash attention, one call per row (it takes [heads, length, head_dim]); shapes as in `fused_attention`."""
  splash = _kernel_module("splash")
  length, heads = q.shape[1:3]
  block = next(b for b in _SPLASH_BLOCKS if length % b == 0)
  sizes = splash.BlockSizes(
    block_q=block,
    block_kv=block,
    block_kv_compute=block,
    block_q_dkv=block,
    block_kv_dkv=block,
    block_kv_dkv_compute=block,
    block_q_dq=block,
    block_kv_dq=block,
  )
  one_head = splash.FullMask((length, length)) if bidirectional else splash.CausalMask((length, length))
  kernel = splash.make_splash_mha(
    splash.MultiHeadMask([one_head] * heads),
    block_sizes=sizes,
    head_shards=1,
    q_seq_shards=1,
    interpret=interpret,
  )

  def one_row(q, k, v, ids):  # [heads, length, head_dim] each
    return kernel(q, k, v, splash.SegmentIds(q=ids, kv=ids))

  heads_first = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
  out = jnp.swapaxes(jax.vmap(one_row)(*heads_first, segment_ids), 1, 2)
  return out.astype(q.dtype)


def segment_key_range(segment_ids: jax.Array, bidirectional: bool) -> tuple[jax.Array, jax.Array | None]:
  """Each query's keys as a range: (first key, one past the last key or None for causal).

  A segment is a run of equal ids; the range is the query's run, cut at the
  query itself when causal (the kernel's causal mask does that cut).

  Args:
    segment_ids: [batch, length] int.

  Returns:
    start [batch, length] int32 and, when bidirectional, end [batch, length] int32.
  """
  length = segment_ids.shape[1]
  index = jnp.arange(length, dtype=jnp.int32)
  boundary = jnp.concatenate(
    [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
  )
  start = jax.lax.cummax(jnp.where(boundary, index, 0), axis=1)
  if not bidirectional:
    return start, None
  last = jnp.concatenate([boundary[:, 1:], jnp.ones_like(boundary[:, :1])], axis=1)
  end = jax.lax.cummin(jnp.where(last, index + 1, length), axis=1, reverse=True)
  return start, end


def _tokamax(q, k, v, segment_ids, bidirectional: bool, interpret: bool) -> jax.Array:
  """tokamax's Pallas Triton flash attention (GQA as is); shapes as in `fused_attention`.

  `interpret` runs its forward kernel in jax's interpreter, off a GPU too:
  tokamax has no interpret flag of its own, so every `pallas_call` it makes
  while this call traces is given one. Its backward kernel is traced later,
  when gradients are taken, and jax 0.12.1's interpreter cannot run it (a
  `program_id` inside a `cond`): gradients need a GPU.
  """
  module = _kernel_module("tokamax")
  base = importlib.import_module("tokamax._src.ops.attention.base")
  start, end = segment_key_range(segment_ids, bidirectional)
  mask = base.Mask(
    k_start=start[:, None], k_end=None if end is None else end[:, None], is_causal=not bidirectional
  )  # [batch, 1 (every head), length]
  op = module.PallasTritonFlashAttention(
    bypass_device_check=interpret, vjp=module.vjp.PallasTritonFlashAttentionVjp(bypass_device_check=interpret)
  )
  with _interpreted_pallas_calls(interpret):
    return op(q, k, v, mask=mask, logits_scale=1.0).astype(q.dtype)


@contextlib.contextmanager
def _interpreted_pallas_calls(interpret: bool):
  """While tracing inside, `jax.experimental.pallas.pallas_call` interprets (when `interpret`)."""
  if not interpret:
    yield
    return
  pallas = importlib.import_module("jax.experimental.pallas")
  with unittest.mock.patch.object(pallas, "pallas_call", functools.partial(pallas.pallas_call, interpret=True)):
    yield
