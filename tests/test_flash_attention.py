"""Fused attention of training forwards (packed segments) against the dense path: logits and gradients.

On the CPU the Pallas kernels run interpreted; the TPU kernel is also compiled ahead of time for a TPU
topology, and the GPU kernel is checked on a GPU when there is one.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from refusion_jax.model import flash, transformer
from refusion_jax.model.config import tiny
from refusion_jax.model.flash import Segments, attend_segments, fused_attention
from refusion_jax.model.transformer import attend_dense, init_model, segment_mask

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 97


def packed_rows(rng: np.random.Generator, batch: int, length: int) -> tuple[np.ndarray, np.ndarray]:
  """Segment ids (1, 2, ... then 0 for the padding that ends a row) and positions restarting per segment."""
  ids = np.zeros((batch, length), np.int32)
  positions = np.zeros((batch, length), np.int32)
  for row in range(batch):
    start, segment, end = 0, 1, int(rng.integers(length // 2, length + 1))
    while start < end:
      size = int(rng.integers(1, end - start + 1))
      ids[row, start : start + size] = segment
      positions[row, start : start + size] = np.arange(size)
      start, segment = start + size, segment + 1
    positions[row, end:] = np.arange(length - end)
  return ids, positions


def random_qkv(rng, batch, length, kv_heads, groups, head_dim):
  """q [batch, length, kv_heads, groups, head_dim] (scaled as the model scales it), k and v [.., kv_heads, ..]."""
  q = rng.normal(size=(batch, length, kv_heads, groups, head_dim)) * head_dim**-0.5
  k, v = (rng.normal(size=(batch, length, kv_heads, head_dim)) for _ in range(2))
  return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))


def dense(q, k, v, ids, bidirectional):
  """The reference: the model's dense attention under the segments' [B, T, T] mask."""
  return attend_dense(q, k, v, None, segment_mask(ids, bidirectional))


def assert_same_attention_and_gradients(attend, q, k, v, ids, bidirectional, err_msg):
  cotangent = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
  want, want_vjp = jax.vjp(lambda q, k, v: dense(q, k, v, ids, bidirectional), q, k, v)
  got, got_vjp = jax.vjp(attend, q, k, v)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=err_msg)
  for name, g, w in zip("qkv", got_vjp(cotangent), want_vjp(cotangent)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=f"d{name} {err_msg}")


def installed(kernel: str):
  """`kernel` as a parameter that skips, naming what is missing, where the installed packages lack it."""
  missing = f"{flash._KERNEL_MODULES[kernel]} is not installed (jax {jax.__version__})"
  return pytest.param(kernel, marks=pytest.mark.skipif(not flash.kernel_available(kernel), reason=missing))


def interpreted_kernel_attention(kernel, ids, bidirectional, shape):
  """attend(q, k, v) for q [batch, length, kv_heads, groups, head_dim] through one kernel, interpreted."""
  batch, length, kv_heads, groups, head_dim = shape

  def attend(q, k, v):
    heads = q.reshape(batch, length, kv_heads * groups, head_dim)
    out = fused_attention(heads, k, v, ids, bidirectional=bidirectional, kernel=kernel, interpret=True)
    return out.reshape(q.shape)

  return attend


@pytest.mark.parametrize("kernel", [installed("splash"), installed("triton")])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_each_kernel_matches_the_dense_path_with_packed_segments_and_gqa(kernel, bidirectional):
  seed = int(np.random.default_rng().integers(1 << 16))
  rng = np.random.default_rng(seed)
  shape = batch, length, _, _, _ = 2, 128, 2, 2, 16
  q, k, v = random_qkv(rng, *shape)
  ids = jnp.asarray(packed_rows(rng, batch, length)[0])
  attend = interpreted_kernel_attention(kernel, ids, bidirectional, shape)
  assert_same_attention_and_gradients(attend, q, k, v, ids, bidirectional, f"{kernel} seed {seed}")


# tokamax's backward kernel does not run in jax's interpreter (tests/helpers/gpu_flash_check.py checks it on a
# GPU): its forward is checked here, over several blocks of keys and segments that start inside a block.
@pytest.mark.parametrize("bidirectional", [False, True])
def test_tokamax_kernel_matches_the_dense_path_with_packed_segments_and_gqa(bidirectional):
  pytest.importorskip("tokamax", reason="tokamax installs with the test extra on Python >= 3.12")
  seed = int(np.random.default_rng().integers(1 << 16))
  rng = np.random.default_rng(seed)
  shape = batch, length, _, _, _ = 2, 256, 2, 3, 16
  q, k, v = random_qkv(rng, *shape)
  ids = jnp.asarray(packed_rows(rng, batch, length)[0])
  got = interpreted_kernel_attention("tokamax", ids, bidirectional, shape)(q, k, v)
  # Both sum a softmax over at most `length` float32 terms, in other orders: a few ulps of the largest value.
  np.testing.assert_allclose(got, dense(q, k, v, ids, bidirectional), rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")


@pytest.mark.parametrize("bidirectional", [False, True])
def test_segment_key_ranges_are_the_segment_mask(bidirectional):
  seed = int(np.random.default_rng().integers(1 << 16))
  ids, _ = packed_rows(np.random.default_rng(seed), 4, 200)
  start, end = flash.segment_key_range(jnp.asarray(ids), bidirectional)
  keys = np.arange(200)[None, None, :]
  sees = keys >= np.asarray(start)[..., None]
  sees &= keys <= np.arange(200)[None, :, None] if end is None else keys < np.asarray(end)[..., None]
  np.testing.assert_array_equal(sees, segment_mask(jnp.asarray(ids), bidirectional), err_msg=f"seed {seed}")


def test_lengths_off_the_block_size_are_padded_with_a_segment_no_token_sees():
  seed = int(np.random.default_rng().integers(1 << 16))
  rng = np.random.default_rng(seed)
  q, k, v = random_qkv(rng, 2, 72, 1, 3, 8)  # one KV head for three query heads
  ids = jnp.asarray(packed_rows(rng, 2, 72)[0])
  attend = lambda q, k, v: attend_segments(q, k, v, Segments(ids))  # noqa: E731
  assert_same_attention_and_gradients(attend, q, k, v, ids, False, f"seed {seed}")


def model_with(impl: str, **overrides):
  return init_model(tiny(vocab_size=VOCAB, attention_impl=impl, **overrides), seed=5)


def training_loss(model, tokens, positions, ids, bidirectional):
  logits, _ = model(tokens, positions, segment_ids=ids, bidirectional=bidirectional)
  labels = jnp.roll(tokens, -1, axis=1)
  ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
  return jnp.sum(ce * (ids > 0)), logits


@pytest.mark.parametrize("bidirectional", [False, True])
def test_flash_model_gives_the_dense_models_logits_and_gradients(bidirectional):
  seed = int(np.random.default_rng().integers(1 << 16))
  rng = np.random.default_rng(seed)
  ids, positions = packed_rows(rng, 3, 40)
  tokens = jnp.asarray(rng.integers(0, VOCAB, ids.shape), jnp.int32)
  step = nnx.jit(nnx.value_and_grad(training_loss, has_aux=True), static_argnums=4)
  results = {
    impl: step(model_with(impl), tokens, jnp.asarray(positions), jnp.asarray(ids), bidirectional)
    for impl in ("xla", "flash")
  }
  (want_loss, want_logits), want_grads = results["xla"]
  (got_loss, got_logits), got_grads = results["flash"]
  np.testing.assert_allclose(got_logits, want_logits, rtol=2e-5, atol=2e-5, err_msg=f"seed {seed}")
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, err_msg=f"seed {seed}")
  # The kernel sums its softmax in another order: up to 1.7e-6 beyond rtol over 30 seeds (a summed loss).
  for (path, a), (_, b) in zip(nnx.to_flat_state(want_grads), nnx.to_flat_state(got_grads)):
    np.testing.assert_allclose(b.get_value(), a.get_value(), rtol=1e-4, atol=1e-5, err_msg=f"{path} seed {seed}")


def forward_jaxpr(impl: str, batch: int, length: int) -> str:
  graphdef, state = nnx.split(model_with(impl))
  ids = jnp.ones((batch, length), jnp.int32)
  tokens = jnp.zeros((batch, length), jnp.int32)
  return str(jax.make_jaxpr(lambda state: nnx.merge(graphdef, state)(tokens, segment_ids=ids)[0])(state))


def test_flash_never_builds_a_dense_mask_and_auto_keeps_the_dense_path_on_cpu():
  batch, length = 3, 40
  dense_mask = f"bool[{batch},{length},{length}]"
  flash, auto = forward_jaxpr("flash", batch, length), forward_jaxpr("auto", batch, length)
  assert "pallas_call" in flash and dense_mask not in flash
  assert "pallas_call" not in auto and dense_mask in auto  # the CPU keeps today's speed


@pytest.mark.parametrize("installed", [(), ("triton",), ("tokamax",), ("triton", "tokamax")])
def test_a_gpu_takes_jaxs_triton_kernel_else_tokamaxs(monkeypatch, installed):
  monkeypatch.setattr(flash, "kernel_available", lambda kernel: kernel in installed)
  assert flash.kernel_for("gpu") == (installed[0] if installed else "tokamax")
  assert flash.kernel_for("tpu") == flash.kernel_for("cpu") == "splash"


def test_where_no_gpu_kernel_is_installed_auto_keeps_the_dense_path_says_why_once_and_flash_says_so(
  monkeypatch, caplog
):
  monkeypatch.setattr(transformer, "target_platform", lambda: "gpu")
  for kernel in flash.GPU_KERNELS:
    monkeypatch.setitem(flash._KERNEL_MODULES, kernel, f"jax.experimental.pallas.ops.gpu.no_{kernel}_kernel")
  with caplog.at_level("WARNING", logger=flash.__name__):
    assert "pallas_call" not in forward_jaxpr("auto", 2, 8)
    assert "pallas_call" not in forward_jaxpr("auto", 2, 16)
  said = [r.getMessage() for r in caplog.records if r.name == flash.__name__]
  assert len(said) == 1 and "dense path" in said[0] and "no_tokamax_kernel is not installed" in said[0], said
  assert 'pip install -e ".[cuda13]"' in said[0]
  monkeypatch.setattr(flash, "target_platform", lambda: "gpu")
  with pytest.raises(ValueError, match="no_tokamax_kernel.*attention_impl=auto"):
    forward_jaxpr("flash", 2, 8)


# `auto` follows the compile target, not the host: traced under a TPU topology's mesh it picks splash attention,
# runs it under shard_map (no gathering of rows or heads), for a length off the block size and a small head_dim.
_TPU_COMPILE = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from refusion_jax.model.config import tiny
    from refusion_jax.model.transformer import init_model
    from refusion_jax.parallel import compiled, sharding
    from refusion_jax.parallel.activations import sharded_activations

    mesh = sharding.make_mesh({"data": 2, "tensor": 2}, compiled.topology_devices("v5p:2x2x1"))
    config = tiny(vocab_size=128, num_heads=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", remat="full")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: init_model(config)))
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                         sharding.state_shardings(state, mesh))
    batch = jax.ShapeDtypeStruct((4, 200), jnp.int32, sharding=NamedSharding(mesh, P(("data", "fsdp"), None)))

    def loss(state, tokens):
      logits, _ = nnx.merge(graphdef, state)(tokens, segment_ids=(tokens > 0).astype(jnp.int32))
      return logits.mean()

    grad = jax.jit(jax.grad(sharded_activations(loss, mesh)))
    text = grad.lower(state, batch).compile().as_text()
    print("kernels", text.count("tpu_custom_call"), "all-gathers", text.count("all-gather"))
""")


@pytest.mark.extra("tpu")
def test_splash_attention_compiles_for_a_tpu_topology():
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  out = subprocess.run(
    [sys.executable, "-c", _TPU_COMPILE], capture_output=True, text=True, env=env, cwd=REPO, timeout=600
  )
  assert out.returncode == 0, out.stderr[-3000:]
  _, kernels, _, gathers = out.stdout.split()[-4:]
  # At least a forward, a dq and a dkv kernel per layer (2 layers), each on its own device's rows and heads:
  # a Pallas call left to XLA's partitioner would have its inputs gathered first.
  assert int(kernels) >= 3 * 2 and int(gathers) == 0, out.stdout


_GPU_CHECK = os.path.join(REPO, "tests", "helpers", "gpu_flash_check.py")


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs an NVIDIA GPU")
def test_gpu_kernel_matches_the_dense_path_and_trains_an_8_layer_qwen3_8b_shape():
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"} | {"PYTHONPATH": REPO}
  out = subprocess.run([sys.executable, _GPU_CHECK], capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
  print(out.stdout)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
