"""Feeding a sequence in pieces through the KV cache gives the one-shot logits,
also when the tokens are stored out of position order (ReFusion's reordering), and
when a whole block is staged and only its leading tokens are committed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.closeness import assert_logits_close, relative_error

from refusion_jax.model.cache import KVCache, append, commit, stage, write
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import causal_mask, init_model

TOLERANCE = 1e-5
LENGTH = 12
PIECES = (5, 1, 4, 2)
VOCAB = 97
# Every test uses the same batch and cache capacity so that the jitted forward
# compiles once per block length only.
BATCH = 3
CAPACITY = 2 * LENGTH


@nnx.jit
def _noisy_model():
  model = init_model(tiny(vocab_size=VOCAB, num_heads=6, num_kv_heads=2), seed=1)
  leaves, treedef = jax.tree.flatten(nnx.state(model, nnx.Param))
  keys = jax.random.split(jax.random.key(2), len(leaves))
  noisy = [leaf + 0.3 * jax.random.normal(key, leaf.shape, leaf.dtype) for leaf, key in zip(leaves, keys)]
  nnx.update(model, jax.tree.unflatten(treedef, noisy))
  return model


@pytest.fixture(scope="module")
def model():
  """A tiny Qwen3 model (GQA ratio 3) whose every parameter is far from its
  init, so attention is sharp and a wrong position or mask changes the logits."""
  return _noisy_model()


@nnx.jit
def _forward(model, tokens, positions, mask=None, cache=None):
  """The model's forward, compiled once per shape (eager dispatch is slow)."""
  return model(tokens, positions, mask, cache)


_append, _write = jax.jit(append), jax.jit(write)


@jax.jit
def _stage_and_commit(cache, kv, positions, kept):
  """Stage every token of the block [batch, width] (rows in order), then commit the first `kept` of each row."""
  batch, width = positions.shape
  rows = jnp.repeat(jnp.arange(batch), width)
  offsets = jnp.tile(jnp.arange(width), batch)
  flat = lambda x: x.reshape(x.shape[0], batch * width, *x.shape[3:])
  cache = stage(cache, flat(kv.k), flat(kv.v), rows, offsets, positions.reshape(-1))
  return commit(cache, kept)


def _feed_in_pieces(model, tokens, positions, store, junk=0):
  """Logits [batch, length, vocab] of feeding `tokens` piece by piece against the cache.

  Args:
    tokens, positions: [batch, length] in the order they are fed (storage order).
    store: "append", "stage" (the whole block staged, its piece committed), or
      [batch, length] cache indices to `write` each token at.
    junk: random tokens added after each piece and not stored, as a rejected
      draft would be; the default causal mask hides them from the piece.
  """
  batch = tokens.shape[0]
  rng = np.random.default_rng(3)
  cache = KVCache.create(model.config, batch, CAPACITY)
  logits, start = [], 0
  for size in PIECES:
    piece = slice(start, start + size)
    block_tokens = jnp.concatenate([tokens[:, piece], rng.integers(0, VOCAB, (batch, junk))], axis=1)
    block_positions = jnp.concatenate([positions[:, piece], rng.integers(0, 4 * LENGTH, (batch, junk))], axis=1)
    out, kv = _forward(model, block_tokens, block_positions, cache=cache)
    take = jnp.arange(size + junk) < size
    take = jnp.broadcast_to(take, (batch, size + junk))
    if isinstance(store, str) and store == "stage":
      cache = _stage_and_commit(cache, kv, block_positions, jnp.full((batch,), size))
    elif isinstance(store, str):
      cache = _append(cache, kv, block_positions, take)
    else:
      indices = jnp.pad(store[:, piece], ((0, 0), (0, junk)))
      cache = _write(cache, kv, indices, block_positions, take)
    logits.append(out[:, :size])
    start += size
  return jnp.concatenate(logits, axis=1)


def _random_tokens(seed):
  return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (BATCH, LENGTH)))


@pytest.mark.parametrize("store", ["append", "stage"])
@pytest.mark.parametrize("junk", [0, 2])
def test_piecewise_causal_feeding_matches_one_shot(model, junk, store):
  tokens = _random_tokens(4)
  positions = jnp.broadcast_to(jnp.arange(LENGTH), tokens.shape)
  one_shot, _ = _forward(model, tokens, positions)
  pieces = _feed_in_pieces(model, tokens, positions, store=store, junk=junk)
  assert_logits_close(pieces, one_shot, TOLERANCE)


def test_staging_drops_what_runs_past_the_capacity_and_touches_only_free_entries():
  rng = np.random.default_rng(8)
  config = tiny(vocab_size=VOCAB)
  capacity, width = 8, 4
  cache = KVCache.create(config, 2, capacity)
  full = (config.num_layers, 2, capacity, config.num_kv_heads, config.head_dim)
  cache = cache.replace(
    k=jnp.asarray(rng.standard_normal(full), jnp.float32),
    v=jnp.asarray(rng.standard_normal(full), jnp.float32),
    length=jnp.asarray([6, 2]),
    valid=jnp.arange(capacity)[None] < jnp.asarray([[6], [2]]),
  )
  block = (config.num_layers, width, config.num_kv_heads, config.head_dim)
  k, v = (jnp.asarray(rng.standard_normal(block), jnp.float32) for _ in range(2))
  # Row 0 has 2 free entries for its 3 tokens; the token of row 1 is padding (offset = capacity: dropped).
  rows, offsets = jnp.asarray([0, 0, 0, 1]), jnp.asarray([0, 1, 2, capacity])
  staged = stage(cache, k, v, rows, offsets, jnp.asarray([10, 11, 12, 13]))
  np.testing.assert_array_equal(staged.k[:, 0, 6:], k[:, :2])
  np.testing.assert_array_equal(staged.k[:, 0, :6], cache.k[:, 0, :6])
  np.testing.assert_array_equal(staged.v[:, 1], cache.v[:, 1])
  np.testing.assert_array_equal(staged.positions[0, 6:], [10, 11])
  np.testing.assert_array_equal(staged.valid, cache.valid)  # staged entries are not attended yet
  committed = commit(staged, jnp.asarray([2, 0]))
  np.testing.assert_array_equal(committed.length, [8, 2])
  np.testing.assert_array_equal(committed.valid, jnp.arange(capacity)[None] < jnp.asarray([[8], [2]]))


@pytest.mark.parametrize("store", ["append", "write"])
def test_permuted_storage_order_matches_one_shot_with_permuted_causal_mask(model, store):
  rng = np.random.default_rng(5)
  tokens = _random_tokens(6)
  # order[b, s] = the true position stored at index s; every row differs.
  order = np.stack([rng.permutation(LENGTH) for _ in range(BATCH)])
  rank = np.argsort(order, axis=1)  # rank[b, p] = storage index of position p
  assert len({tuple(row) for row in order}) == BATCH

  # One shot, in true position order: p sees q iff q was stored no later than p.
  mask = jnp.asarray(rank[:, None, :] <= rank[:, :, None])
  one_shot, _ = _forward(model, tokens, jnp.broadcast_to(jnp.arange(LENGTH), tokens.shape), mask)

  indices = "append" if store == "append" else np.stack([rng.permutation(CAPACITY)[:LENGTH] for _ in range(BATCH)])
  stored = _feed_in_pieces(model, jnp.take_along_axis(tokens, order, axis=1), jnp.asarray(order), indices)
  assert_logits_close(np.take_along_axis(np.asarray(stored), rank[:, :, None], axis=1), one_shot, TOLERANCE)


def test_a_wrong_position_is_detected(model):
  """The check above has teeth: storing one token under a wrong position breaks it."""
  tokens = _random_tokens(7)
  positions = jnp.broadcast_to(jnp.arange(LENGTH), tokens.shape)
  one_shot, _ = _forward(model, tokens, positions, causal_mask(BATCH, LENGTH))
  pieces = _feed_in_pieces(model, tokens, positions.at[1, 2].set(3), store="append")
  assert relative_error(pieces, one_shot) > 100 * TOLERANCE
