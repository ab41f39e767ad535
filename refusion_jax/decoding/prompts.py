"""Prompts on their way in: length buckets, right padding, and the prefill forward into a fresh cache.

Prompts are right-padded to the smallest of a few bucket lengths, so new
prompts of a known bucket reuse the compiled decode program; padding is never
attended (docs/method.md §3.4). Where the decode loop keeps a prefix cache
(`prefix_cache`), the prefill takes the prompt's cached prefix and runs only
the rest, at the narrowest of a few compiled widths that holds it.
"""

from __future__ import annotations

from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from refusion_jax.decoding.mesh import constrain_cache
from refusion_jax.decoding.prefix_cache import PrefixReuse, active_reuse, restore
from refusion_jax.model import cache as kv_cache
from refusion_jax.model.transformer import Transformer

# Prompt lengths are padded up to the smallest bucket that holds them.
PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# With a prefix cache, the prefill after a cached prefix runs at the narrowest of these widths (times 4 from 16, then
# the bucket) that holds the rest of the prompt: a few compiled forwards, none more than 4x the work.
PREFILL_WIDTH_STEP, NARROWEST_PREFILL = 4, 16


def prefill_widths(width: int) -> tuple[int, ...]:
  """The compiled widths of a prefill after a cached prefix, for prompts of bucket `width`."""
  widths, step = [], NARROWEST_PREFILL
  while step < width:
    widths.append(step)
    step *= PREFILL_WIDTH_STEP
  return (*widths, width)


def bucket_length(length: int, buckets: Sequence[int] = PROMPT_BUCKETS) -> int:
  """The smallest bucket that holds `length` tokens."""
  for bucket in buckets:
    if length <= bucket:
      return bucket
  raise ValueError(f"A prompt of {length} tokens is longer than the largest bucket ({buckets[-1]}).")


def pad_prompts(
  prompts: Sequence[Sequence[int]], pad_id: int, buckets: Sequence[int] = PROMPT_BUCKETS
) -> tuple[np.ndarray, np.ndarray]:
  """Right-pad prompts into one bucket.

  Returns:
    tokens [B, bucket] int32 and lengths [B] int32.
  """
  lengths = np.array([len(p) for p in prompts], np.int32)
  width = bucket_length(int(lengths.max()), buckets)
  tokens = np.full((len(prompts), width), pad_id, np.int32)
  for row, prompt in enumerate(prompts):
    tokens[row, : len(prompt)] = prompt
  return tokens, lengths


def prefill(
  model: Transformer, tokens: jax.Array, lengths: jax.Array, capacity: int
) -> tuple[jax.Array, kv_cache.KVCache]:
  """The prompt forward into a fresh cache (causal over each row's valid prompt tokens).

  Traced while the loop offers the admission a cached prefix (`prefix_cache.reusing`, one prompt), the prefix's
  keys and values come from the pool and only the rest is computed; its logits are then those of the rest only
  (zeros at the prefix's columns; the last prompt token's are always there). An admit that puts this cache into its
  row unchanged lets the loop store the prompt's blocks for later prompts (docs/serving.md, "The prefix cache").

  Args:
    tokens: [batch, width] right-padded prompt ids; lengths: [batch] true lengths.
    capacity: cache entries per row (width + the answer's).

  Returns:
    logits [batch, width, vocab] and a `KVCache` holding the prompts at indices 0..lengths-1.
  """
  chex.assert_rank([tokens, lengths], [2, 1])
  chex.assert_type([tokens, lengths], int)
  reuse = active_reuse()
  if reuse is not None:
    return _prefill_after_prefix(model, tokens, lengths, capacity, reuse)
  batch, width = tokens.shape
  columns = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
  valid = columns < lengths[:, None]
  causal = jnp.tril(jnp.ones((width, width), bool))[None] & valid[:, None, :]
  logits, kv = model(tokens, columns, causal)
  cache = constrain_cache(kv_cache.KVCache.create(model.config, batch, capacity))
  return logits, kv_cache.append(cache, kv, columns, valid)


def _prefill_after_prefix(
  model: Transformer, tokens: jax.Array, lengths: jax.Array, capacity: int, reuse: PrefixReuse
) -> tuple[jax.Array, kv_cache.KVCache]:
  """`prefill` of one prompt whose first `reuse.tokens` tokens' keys and values are in the pool: those are
  copied into the cache, and the rest runs at the narrowest `prefill_widths` width W that holds it
  (`lax.switch`).

  A forward of width W ends inside the bucket P, so it starts at column min(reused, P - W): the reused tokens
  before it are attended in the cache, cut to its first P - W entries, and those inside it (recomputed, not
  stored again) in the block. Every width thus attends over P keys, as the prefill without a cache does, and a
  prompt with nothing reused pays what that prefill pays."""
  chex.assert_shape(lengths, (1,))
  reuse.used = True
  width = tokens.shape[1]
  reused = reuse.tokens
  cache = restore(kv_cache.KVCache.create(model.config, 1, capacity), reuse.pool, reuse.slot, reused)
  widths = prefill_widths(width)
  branch = jnp.sum(jnp.asarray(widths[:-1]) < lengths[0] - reused)

  def run(query_width: int):
    def forward(cache: kv_cache.KVCache) -> tuple[jax.Array, kv_cache.KVCache]:
      first = jnp.minimum(reused, width - query_width)
      columns = (first + jnp.arange(query_width, dtype=jnp.int32))[None]
      query = jax.lax.dynamic_slice_in_dim(tokens, first, query_width, axis=1)
      in_prompt = columns < lengths[:, None]
      causal = jnp.tril(jnp.ones((query_width, query_width), bool))[None] & in_prompt[:, None, :]
      if query_width == width:  # the whole bucket: no cached entry is attended
        logits, kv = model(query, columns, causal)
      else:
        before = _first_entries(cache, width - query_width, first)
        logits, kv = model(query, columns, kv_cache.block_mask(before, causal), before)
      placed = jnp.zeros((1, width, logits.shape[-1]), logits.dtype)
      fresh = (columns >= reused) & in_prompt
      return jax.lax.dynamic_update_slice_in_dim(placed, logits, first, axis=1), kv_cache.append(
        cache, kv, columns, fresh
      )

    return forward

  logits, cache = jax.lax.switch(branch, [run(w) for w in widths], cache)
  return logits, constrain_cache(cache)


def _first_entries(cache: kv_cache.KVCache, count: int, valid: jax.Array) -> kv_cache.KVCache:
  """The cache cut to its first `count` entries, of which the first `valid` [] are valid."""
  index = jnp.arange(count, dtype=jnp.int32)[None]
  return kv_cache.KVCache(
    k=cache.k[:, :, :count],
    v=cache.v[:, :, :count],
    positions=cache.positions[:, :count],
    valid=index < valid,
    length=jnp.minimum(cache.length, valid),
  )
