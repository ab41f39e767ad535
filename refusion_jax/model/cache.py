"""A fixed-capacity KV cache held as plain data, and the masked writes into it.

The cache stores tokens in *storage order* (the order in which they were
decided), each with its true RoPE position. Its shapes never change: writing
is a scatter at given indices, and "cropping" is simply not advancing
`length`. Keys are stored after RoPE (and after the Qwen3 q/k norm), so an
entry never needs its position again except for bookkeeping.
"""

from __future__ import annotations

import math

import chex
import flax.struct
import jax
import jax.numpy as jnp

from refusion_jax.model.config import ModelConfig


@flax.struct.dataclass
class BlockKV:
  """Keys and values a forward computed for its query block.

  k, v: [layers, batch, block, kv_heads, head_dim]
  """

  k: jax.Array
  v: jax.Array


@flax.struct.dataclass
class KVCache:
  """Per-layer keys and values plus per-entry bookkeeping.

  k, v:       [layers, batch, capacity, kv_heads, head_dim]
  positions:  [batch, capacity] int32, the true position of each entry
  valid:      [batch, capacity] bool, whether the entry holds a token
  length:     [batch] int32, the next free index (entries are written densely)
  """

  k: jax.Array
  v: jax.Array
  positions: jax.Array
  valid: jax.Array
  length: jax.Array

  @classmethod
  def create(cls, config: ModelConfig, batch: int, capacity: int) -> KVCache:
    shape = (config.num_layers, batch, capacity, config.num_kv_heads, config.head_dim)
    return cls(
      k=jnp.zeros(shape, config.compute_dtype),
      v=jnp.zeros(shape, config.compute_dtype),
      positions=jnp.zeros((batch, capacity), jnp.int32),
      valid=jnp.zeros((batch, capacity), bool),
      length=jnp.zeros((batch,), jnp.int32),
    )

  @property
  def capacity(self) -> int:
    return self.k.shape[2]

  def take_rows(self, rows: jax.Array) -> KVCache:
    """The cache of batch rows `rows` [R] (in that order): keys and values hold the batch on axis 1."""
    return KVCache(
      k=jnp.take(self.k, rows, axis=1),
      v=jnp.take(self.v, rows, axis=1),
      positions=self.positions[rows],
      valid=self.valid[rows],
      length=self.length[rows],
    )

  def put_rows(self, start: jax.Array, rows: KVCache) -> KVCache:
    """This cache with batch rows start, start + 1, ... replaced by the R rows of `rows` (same capacity)."""
    put = lambda full, part, axis: jax.lax.dynamic_update_slice_in_dim(full, part.astype(full.dtype), start, axis)
    return KVCache(
      k=put(self.k, rows.k, 1),
      v=put(self.v, rows.v, 1),
      positions=put(self.positions, rows.positions, 0),
      valid=put(self.valid, rows.valid, 0),
      length=put(self.length, rows.length, 0),
    )


def kv_cache_bytes(config: ModelConfig, batch: int, capacity: int) -> int:
  """Bytes of a `KVCache` of that batch and capacity (computed from shapes, nothing allocated)."""
  shapes = jax.eval_shape(lambda: KVCache.create(config, batch, capacity))
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def write(
  cache: KVCache,
  kv: BlockKV,
  indices: jax.Array,
  positions: jax.Array,
  write_mask: jax.Array,
) -> KVCache:
  """Scatter block entries into the cache at explicit indices.

  Args:
    cache: the cache to update (functionally).
    kv: keys/values of the block, [layers, batch, block, kv_heads, head_dim].
    indices: [batch, block] int32 destination index of each block token.
    positions: [batch, block] int32 true positions of the block tokens.
    write_mask: [batch, block] bool; tokens with False are not written.

  Returns:
    The cache with the masked entries written and marked valid. `length` is
    left unchanged; `append` is the usual way to extend the cache.
  """
  layers, batch, capacity, kv_heads, head_dim = cache.k.shape
  block = indices.shape[-1]
  chex.assert_shape([kv.k, kv.v], (layers, batch, block, kv_heads, head_dim))
  chex.assert_shape([indices, positions, write_mask], (batch, block))
  chex.assert_type([indices, positions, write_mask], [int, int, bool])
  # Out-of-range indices are dropped by the scatter: that is the mask.
  target = jnp.where(write_mask, indices, capacity)
  batch_idx = jnp.arange(target.shape[0])[:, None]
  cache = _put_entries(cache, kv.k, kv.v, batch_idx, target, positions)
  return cache.replace(valid=cache.valid.at[batch_idx, target].set(True, mode="drop"))


def _put_entries(cache: KVCache, k: jax.Array, v: jax.Array, rows, target, positions) -> KVCache:
  """Keys, values [layers, *index, kv_heads, head_dim] and positions [*index] at entries (rows, target),
  indices broadcast together; a target of `capacity` drops the entry. Validity is left alone."""
  put = lambda dst, src: dst.at[:, rows, target].set(src.astype(dst.dtype), mode="drop")
  return cache.replace(
    k=put(cache.k, k), v=put(cache.v, v), positions=cache.positions.at[rows, target].set(positions, mode="drop")
  )


def append(cache: KVCache, kv: BlockKV, positions: jax.Array, take: jax.Array) -> KVCache:
  """Append the taken block tokens, in block order, after each row's last entry.

  Args:
    kv: [layers, batch, block, kv_heads, head_dim].
    positions: [batch, block] true positions.
    take: [batch, block] bool; the taken tokens keep their block order.
  """
  take = take.astype(bool)
  rank = jnp.cumsum(take, axis=-1) - 1
  indices = cache.length[:, None] + rank
  cache = write(cache, kv, indices, positions, take)
  return cache.replace(length=cache.length + take.sum(-1).astype(jnp.int32))


def stage(
  cache: KVCache, k: jax.Array, v: jax.Array, rows: jax.Array, offsets: jax.Array, positions: jax.Array
) -> KVCache:
  """Write tokens' keys and values after their rows' last entries, not yet valid (`commit` makes them so).

  For a decoder that keeps a *prefix* of each block it ran (ReFusion keeps
  the leading active tokens of its compact block): the forward's keys and
  values go in once, and the commit is a count per row. Staged entries past a
  row's commit are never attended and are overwritten by the next stage.
  Entries past the capacity are dropped (a committed prefix always fits).

  Args:
    k, v: [layers, N, kv_heads, head_dim] of N tokens.
    rows: [N] the cache row of each token.
    offsets: [N] its entry after the row's last one (0 = the first free
      entry); an offset >= capacity drops the token.
    positions: [N] true positions.
  """
  chex.assert_shape([k, v], (cache.k.shape[0], rows.shape[0], *cache.k.shape[3:]))
  chex.assert_shape([rows, offsets, positions], rows.shape)
  target = jnp.minimum(cache.length[rows] + offsets, cache.capacity)  # capacity: dropped
  return _put_entries(cache, k, v, rows, target, positions)


def commit(cache: KVCache, counts: jax.Array) -> KVCache:
  """Make the first `counts` [batch] staged entries of each row valid (see `stage`)."""
  index = jnp.arange(cache.capacity)[None]
  start = cache.length[:, None]
  kept = (index >= start) & (index < start + counts[:, None])
  return cache.replace(valid=cache.valid | kept, length=cache.length + counts.astype(jnp.int32))


def block_mask(cache: KVCache, within_block: jax.Array) -> jax.Array:
  """The full attention mask of a block that sees every valid cache entry.

  Args:
    within_block: [batch, block, block] bool, which block tokens each query sees.

  Returns:
    [batch, block, capacity + block] bool.
  """
  batch, block, _ = within_block.shape
  sees_cache = jnp.broadcast_to(cache.valid[:, None, :], (batch, block, cache.capacity))
  return jnp.concatenate([sees_cache, within_block], axis=-1)
