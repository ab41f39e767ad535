"""The GPU's fused attention kernels against the dense path, their speed, then an 8-layer Qwen3-8B-shaped
training step at 2 x 4096 under `attention_impl="auto"`.

    python tests/helpers/gpu_flash_check.py        # on a machine with an NVIDIA GPU (about three minutes)

Run by tests/test_flash_attention.py when `nvidia-smi` exists. Checks and times every GPU kernel installed
(`flash.GPU_KERNELS`: jax's Pallas Triton kernel up to jax 0.12.0, tokamax's), prints which one `auto` takes,
and exits non-zero, saying what differed, when a kernel's attention or gradients leave the dense path's, or
when the training step's loss does. The timings are the measured reason for `flash.GPU_KERNELS`' order.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from refusion_jax.model import flash
from refusion_jax.model.config import preset
from refusion_jax.model.flash import fused_attention, target_platform
from refusion_jax.model.transformer import attend_dense, init_model, segment_mask


def packed_ids(rng: np.random.Generator, batch: int, length: int, segments: int) -> np.ndarray:
  """[batch, length] segment ids: `segments` random-length examples per row, then padding (id 0)."""
  ids = np.zeros((batch, length), np.int32)
  for row in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, length), segments, replace=False))
    for segment, (start, end) in enumerate(zip([0, *cuts[:-1]], cuts), start=1):
      ids[row, start:end] = segment
  return ids


def check_kernel(rng: np.random.Generator, kernel: str) -> None:
  """One kernel against the dense path on a small packed GQA shape: outputs and gradients, float32 and bfloat16.

  The bounds (relative to the largest entry) allow TF32 / bfloat16 matmuls; a wrong mask errs by order 1.
  """
  batch, length, kv_heads, groups, head_dim = 2, 384, 2, 4, 128
  ids = jnp.asarray(packed_ids(rng, batch, length, 3))
  for dtype, tolerance in ((jnp.float32, 1e-2), (jnp.bfloat16, 5e-2)):
    q = jnp.asarray(rng.normal(size=(batch, length, kv_heads, groups, head_dim)) * head_dim**-0.5, dtype)
    k, v = (jnp.asarray(rng.normal(size=(batch, length, kv_heads, head_dim)), dtype) for _ in range(2))
    cotangent = jnp.asarray(rng.normal(size=q.shape), dtype)
    for bidirectional in (False, True):
      mask = segment_mask(ids, bidirectional)
      want = _value_and_vjp(lambda q, k, v, mask=mask: attend_dense(q, k, v, None, mask), q, k, v, cotangent)
      attend = _kernel_attention(kernel, ids, bidirectional)
      got = _value_and_vjp(attend, q, k, v, cotangent)
      for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        error = np.abs(g - w).max() / max(np.abs(w).max(), 1e-6)
        print(f"{kernel} {jnp.dtype(dtype).name} bidirectional={bidirectional} {name}: max error {error:.2e} of max")
        assert error < tolerance, f"{kernel}: {name} differs from the dense path ({dtype}, {bidirectional=})"


def _kernel_attention(kernel: str, ids: jax.Array, bidirectional: bool):
  """attend(q, k, v), q [batch, length, kv_heads, groups, head_dim], through `kernel` (length a multiple of 128)."""

  def attend(q, k, v):
    batch, length, kv_heads, groups, head_dim = q.shape
    heads = q.reshape(batch, length, kv_heads * groups, head_dim)
    out = fused_attention(heads, k, v, ids, bidirectional=bidirectional, kernel=kernel, interpret=False)
    return out.reshape(q.shape)

  return attend


def time_kernels(rng: np.random.Generator, kernels: list[str]) -> None:
  """Forward + backward of one Qwen3-8B attention layer (32 query heads, 8 KV heads, head_dim 128, bf16) on
  8 x 4096 packed rows: each kernel, and the dense path at 2 x 4096 (8 rows of it ran an H200 out of memory)."""
  kv_heads, groups, head_dim, length = 8, 4, 128, 4096
  for kernel, batch in [*((kernel, 8) for kernel in kernels), ("dense", 2)]:
    ids = jnp.asarray(packed_ids(rng, batch, length, 4))
    q = jnp.asarray(rng.normal(size=(batch, length, kv_heads, groups, head_dim)) * head_dim**-0.5, jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(batch, length, kv_heads, head_dim)), jnp.bfloat16) for _ in range(2))
    cotangent = jnp.ones_like(q)
    if kernel == "dense":
      mask = segment_mask(ids, False)
      attend = lambda q, k, v, mask=mask: attend_dense(q, k, v, None, mask)  # noqa: E731
    else:
      attend = _kernel_attention(kernel, ids, False)
    run = _jitted_value_and_vjp(attend)
    jax.block_until_ready(run(q, k, v, cotangent))  # compile
    started = time.perf_counter()
    for _ in range(5):
      jax.block_until_ready(run(q, k, v, cotangent))
    seconds = (time.perf_counter() - started) / 5
    # Nominal FLOPs, as flash attention counts them: forward QKᵀ and PV, backward QKᵀ again, dO·Vᵀ, Pᵀ·dO, dS·K
    # and dSᵀ·Q: 7 matmuls of 2·T²·head_dim per head, halved by the causal mask (the dense path computes all).
    flops = 7 * 2 * length * length * head_dim * kv_heads * groups * batch / 2
    rate = flops / seconds / 1e12
    print(f"attention {kernel} {batch} x {length}: {seconds * 1e3:.1f} ms forward+backward, {rate:.0f} TFLOP/s")


def _value_and_vjp(attend, q, k, v, cotangent):
  """(attention, dq, dk, dv) of `attend` at (q, k, v) for `cotangent`, jitted."""
  return _jitted_value_and_vjp(attend)(q, k, v, cotangent)


def _jitted_value_and_vjp(attend):
  """The jitted (q, k, v, cotangent) -> (attention, dq, dk, dv) of `attend`: one compile for repeated calls."""

  @jax.jit
  def run(q, k, v, cotangent):
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(cotangent))

  return run


def check_training_step(rng: np.random.Generator) -> None:
  """An 8-layer Qwen3-8B-shaped model, bf16 compute, f32 weights, batch 2 x 4096 packed: flash against dense."""
  batch, length = 2, 4096
  ids = packed_ids(rng, batch, length, 4)
  positions = np.zeros_like(ids)
  for row in range(batch):
    for segment in np.unique(ids[row]):
      where = ids[row] == segment
      positions[row, where] = np.arange(where.sum())
  tokens = jnp.asarray(rng.integers(0, 151_936, (batch, length)), jnp.int32)
  ids, positions = jnp.asarray(ids), jnp.asarray(positions)

  def loss(model):
    logits, _ = model(tokens, positions, segment_ids=ids)
    labels = jnp.roll(tokens, -1, axis=1)
    ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
    return jnp.sum(ce * (ids > 0)) / jnp.sum(ids > 0)

  losses = {}
  for impl in ("auto", "xla"):
    config = preset("qwen3_8b", num_layers=8, dtype="bfloat16", remat="full", scan_layers=True, attention_impl=impl)
    model = init_model(config, seed=0)
    step = nnx.jit(nnx.value_and_grad(loss))
    started = time.perf_counter()
    value, grads = step(model)
    jax.block_until_ready(grads)
    compiled = time.perf_counter() - started
    started = time.perf_counter()
    value, grads = step(model)
    jax.block_until_ready(grads)
    finite = all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    print(
      f"8-layer Qwen3-8B shape, 2 x 4096, attention_impl={impl}: loss {float(value):.5f}, first call "
      f"{compiled:.1f} s, step {time.perf_counter() - started:.3f} s, gradients finite: {finite}"
    )
    assert finite, f"non-finite gradients with attention_impl={impl}"
    losses[impl] = float(value)
    del model, grads
  assert abs(losses["auto"] - losses["xla"]) < 1e-2 * abs(losses["xla"]), losses


def main() -> None:
  assert target_platform() == "gpu", f"no GPU: jax runs on {jax.default_backend()}"
  print(jax.devices()[0].device_kind, "jax", jax.__version__)
  rng = np.random.default_rng(0)
  kernels = [kernel for kernel in flash.GPU_KERNELS if flash.kernel_available(kernel)]
  print("GPU kernels installed:", kernels, "| auto takes:", flash.kernel_for("gpu") if kernels else "the dense path")
  for kernel in kernels:
    check_kernel(rng, kernel)
  time_kernels(rng, kernels)
  check_training_step(rng)
  print("GPU flash attention: OK")


if __name__ == "__main__":
  main()
