"""Remat policies and scanned layers change what is kept and how the program is built, never the numbers."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from refusion_jax.checkpoints.load import load_model
from refusion_jax.checkpoints.orbax import Checkpoints, model_meta
from refusion_jax.model import cache as kv_cache
from refusion_jax.model.config import ModelConfig, tiny
from refusion_jax.model.remat import POLICIES
from refusion_jax.model.transformer import init_model

VOCAB = 89


def model_with(**overrides):
  # Execution fields do not enter the initialisation: one seed, the same weights.
  return init_model(tiny(vocab_size=VOCAB, num_layers=3, attention_impl="xla", **overrides), seed=11)


def packed_batch(seed: int, batch: int = 2, length: int = 24):
  """Tokens, positions restarting per segment and segment ids (two examples per row, padding at the end)."""
  rng = np.random.default_rng(seed)
  ids = np.zeros((batch, length), np.int32)
  positions = np.zeros((batch, length), np.int32)
  for row in range(batch):
    first, end = int(rng.integers(3, length // 2)), int(rng.integers(length // 2 + 2, length + 1))
    ids[row, :first], ids[row, first:end] = 1, 2
    positions[row, :first], positions[row, first:end] = np.arange(first), np.arange(end - first)
  tokens = rng.integers(0, VOCAB, (batch, length))
  return jnp.asarray(tokens, jnp.int32), jnp.asarray(positions), jnp.asarray(ids)


def loss_fn(model, tokens, positions, ids):
  logits, _ = model(tokens, positions, segment_ids=ids)
  labels = jnp.roll(tokens, -1, axis=1)
  ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
  return jnp.sum(ce * (ids > 0)), logits


def loss_and_grads(model, batch):
  return nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))(model, *batch)


def test_remat_booleans_of_older_configs_and_checkpoints_name_policies():
  assert tiny(remat=True).remat == "full" and tiny(remat=False).remat == "none"
  meta = dataclasses.asdict(tiny()) | {"remat": True}
  del meta["scan_layers"]  # a checkpoint written before scanned layers existed
  assert ModelConfig(**meta) == tiny(remat="full")
  with pytest.raises(ValueError, match="remat='minimal'.*'projections'"):
    tiny(remat="minimal")


@pytest.mark.parametrize(
  "remat, scan_layers",
  [("full", False), ("projections", False), ("projections_except_mlp", False), ("none", True), ("projections", True)],
)
def test_remat_policies_and_scanned_layers_give_the_same_loss_and_gradients(remat, scan_layers):
  seed = int(np.random.default_rng().integers(1 << 16))
  batch = packed_batch(seed)
  (want_loss, want_logits), want = loss_and_grads(model_with(), batch)
  (got_loss, got_logits), got = loss_and_grads(model_with(remat=remat, scan_layers=scan_layers), batch)
  np.testing.assert_allclose(got_logits, want_logits, rtol=1e-6, atol=2e-6, err_msg=f"seed {seed}")
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6, err_msg=f"seed {seed}")
  # Recomputed activations round differently from stored ones: up to 1.9e-6 beyond rtol over 40 seeds (a summed
  # loss; gradient entries up to order 1).
  for (path, a), (_, b) in zip(nnx.to_flat_state(want), nnx.to_flat_state(got)):
    np.testing.assert_allclose(b.get_value(), a.get_value(), rtol=1e-4, atol=1e-5, err_msg=f"{path} seed {seed}")


def saved_for_backward(model, batch) -> int:
  """Elements the forward keeps for the backward pass (the residuals of its VJP)."""
  graphdef, state = nnx.split(model)
  _, vjp = jax.vjp(lambda state: loss_fn(nnx.merge(graphdef, state), *batch)[0], state)
  return sum(leaf.size for leaf in jax.tree.leaves(vjp))


def test_each_policy_keeps_less_than_the_one_before():
  batch = packed_batch(0)
  kept = {remat: saved_for_backward(model_with(remat=remat), batch) for remat in POLICIES}
  order = ["none", "projections", "projections_except_mlp", "full"]
  assert sorted(kept, key=kept.get, reverse=True) == order, kept
  assert len(set(kept.values())) == len(kept), kept


def test_scanned_layers_take_a_cache_and_a_mask_like_the_loop():
  rng = np.random.default_rng(3)
  batch, block, capacity = 2, 5, 7
  loop, scanned = model_with(), model_with(scan_layers=True)
  cache = kv_cache.KVCache.create(loop.config, batch, capacity)
  cache = cache.replace(
    k=jnp.asarray(rng.normal(size=cache.k.shape), jnp.float32),
    v=jnp.asarray(rng.normal(size=cache.v.shape), jnp.float32),
    valid=jnp.asarray(np.arange(capacity)[None] < np.array([[4], [7]])),
  )
  tokens = jnp.asarray(rng.integers(0, VOCAB, (batch, block)), jnp.int32)
  positions = jnp.asarray(rng.permutation(12)[None, :block].repeat(batch, 0), jnp.int32)
  mask = jnp.asarray(rng.random((batch, block, capacity + block)) < 0.6)
  forward = nnx.jit(lambda model: model(tokens, positions, mask, cache))
  (want_logits, want_kv), (got_logits, got_kv) = forward(loop), forward(scanned)
  # Two programs, so XLA may sum each layer's float32 reductions in other orders: each result moves by a few
  # ulps of its largest term, and three layers compound that. Bounded by 64 ulps of the tensor's largest entry
  # (7.6e-6 of it); jax 0.12.1 differed by 1.2e-6 in 1 of 960 keys, a mask or layer mix-up by order 1.
  for got, want in ((got_logits, want_logits), (got_kv.k, want_kv.k), (got_kv.v, want_kv.v)):
    np.testing.assert_allclose(got, want, rtol=0, atol=64 * np.finfo(np.float32).eps * np.abs(want).max())
  assert got_kv.k.shape == (3, batch, block, 2, 16)


def count_matmuls(model, batch) -> int:
  graphdef, state = nnx.split(model)
  step = jax.jit(jax.grad(lambda state: loss_fn(nnx.merge(graphdef, state), *batch)[0]))
  return step.lower(state).as_text().count("dot_general")


def test_the_scanned_program_holds_one_layer():
  batch = packed_batch(1)
  loop, scanned = count_matmuls(model_with(), batch), count_matmuls(model_with(scan_layers=True), batch)
  # Three layers unrolled against one layer body (plus the embedding and head in both).
  assert scanned < loop / 2, (scanned, loop)


def save(directory: str, model, meta: dict | None = None) -> None:
  with Checkpoints(directory) as checkpoints:
    checkpoints.save_model(1, params=nnx.state(model), meta=meta or model_meta(model.config, "bytes"))
    checkpoints.wait()


@pytest.mark.parametrize("saved_scanned", [True, False])
def test_a_checkpoint_saved_either_way_loads_into_the_other(tmp_path, saved_scanned):
  original = model_with(scan_layers=saved_scanned, remat="full")
  save(str(tmp_path), original)
  loaded = load_model(str(tmp_path))
  assert loaded.config.scan_layers == saved_scanned
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: model_with(scan_layers=not saved_scanned)))
  other = nnx.merge(graphdef, nnx.state(loaded))
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, VOCAB, (2, 9)), jnp.int32)
  np.testing.assert_allclose(np.asarray(other(tokens)[0]), np.asarray(original(tokens)[0]), rtol=1e-6, atol=1e-6)


def test_older_checkpoint_with_a_boolean_remat_loads(tmp_path):
  model = model_with()
  meta = model_meta(model.config, "bytes")
  meta["model_config"]["remat"] = True
  del meta["model_config"]["scan_layers"]
  save(str(tmp_path), model, meta)
  loaded = load_model(str(tmp_path))
  assert (loaded.config.remat, loaded.config.scan_layers) == ("full", False)
