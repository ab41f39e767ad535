"""Prompts on their way in: length buckets, right padding, and the prefill forward into a fresh cache.

Prompts are right-padded to the smallest of a few bucket lengths, so new
prompts of a known bucket reuse the compiled decode program; padding is never
attended (docs/method.md §3.4).
"""

from __future__ import annotations

from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from refusion_jax.decoding.mesh import constrain_cache
from refusion_jax.model import cache as kv_cache
from refusion_jax.model.transformer import Transformer

# Prompt lengths are padded up to the smallest bucket that holds them.
PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


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

  Args:
    tokens: [batch, width] right-padded prompt ids; lengths: [batch] true lengths.
    capacity: cache entries per row (width + the answer's).

  Returns:
    logits [batch, width, vocab] and a `KVCache` holding the prompts at indices 0..lengths-1.
  """
  chex.assert_rank([tokens, lengths], [2, 1])
  chex.assert_type([tokens, lengths], int)
  batch, width = tokens.shape
  columns = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
  valid = columns < lengths[:, None]
  causal = jnp.tril(jnp.ones((width, width), bool))[None] & valid[:, None, :]
  logits, kv = model(tokens, columns, causal)
  cache = constrain_cache(kv_cache.KVCache.create(model.config, batch, capacity))
  return logits, kv_cache.append(cache, kv, columns, valid)
