"""The decoders' reads of the logits: the first maximum, token probabilities without a softmax, Gumbel noise.

Sampling is Gumbel-max with noise keyed by (prompt, step), so a sampled
decode is the same whichever row decodes a prompt and however the rows of a
batch advance (docs/method.md §4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def first_argmax(x: jax.Array) -> jax.Array:
  """`jnp.argmax(x, axis=-1)` (the first maximum) as int32, in two plain reductions.

  XLA's CPU backend runs argmax's (value, index) reduction unvectorised, which
  makes it a costly op of a small model's decode step; max, then the smallest
  index holding it, gives the same index.
  """
  index = jnp.arange(x.shape[-1], dtype=jnp.int32)
  return jnp.min(jnp.where(x == jnp.max(x, axis=-1, keepdims=True), index, x.shape[-1]), axis=-1)


def log_partition(logits: jax.Array) -> jax.Array:
  """log Σ_v exp(logits[..., v]): [batch, length, vocab] -> [batch, length] float32.

  With it the decoders read the probability of any token without the
  [batch, length, vocab] float32 softmax, which at a real vocabulary is the
  largest buffer of a decode step (sizes: results/README.md, "Measurements the
  code relies on"): XLA fuses the exponentials into the reduction.
  """
  return jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)


def token_probs(logits: jax.Array, log_z: jax.Array, tokens: jax.Array) -> jax.Array:
  """Softmax probabilities of given tokens: exp(logits[b, t, tokens[b, t]] - log_z[b, t]).

  Args:
    logits: [batch, length, vocab]; log_z: [batch, length] from `log_partition`;
    tokens: [batch, length] int ids.

  Returns:
    [batch, length] float32.
  """
  picked = jnp.take_along_axis(logits, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return jnp.exp(picked.astype(jnp.float32) - log_z)


def row_gumbel_noise(keys: jax.Array, steps: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Gumbel noise [B, *shape]: row b (its prompt's key k_b, at step s_b) draws from fold_in(k_b, s_b).

  Keying the noise by prompt (`contract.Sampling.key`: fold_in(key(seed), the
  prompt's index)) and step keeps sampled decoding reproducible however the
  rows of a batch advance and whichever row decodes a prompt.

  Args:
    keys: [B] typed PRNG keys of each row's prompt; steps: [B] int32.
  """
  keys = jax.vmap(jax.random.fold_in)(keys, steps)
  return jax.vmap(lambda k: jax.random.gumbel(k, shape, jnp.float32))(keys)


def sampling_noise(keys: jax.Array, temperatures: jax.Array, steps: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """temperature_b * `row_gumbel_noise` [B, *shape], drawn only when some row samples: rows at temperature 0
  add exact zeros, and a call where every row is greedy (a server's greedy requests) skips the draw.

  Args:
    keys, temperatures, steps: [B] each row's prompt's noise key and temperature, and its step.
  """
  draw = lambda: temperatures.reshape(-1, *(1,) * len(shape)) * row_gumbel_noise(keys, steps, shape)
  zeros = lambda: jnp.zeros((temperatures.shape[0], *shape), jnp.float32)
  return jax.lax.cond(jnp.any(temperatures > 0), draw, zeros)


def pick_tokens(
  logits: jax.Array, keys: jax.Array, temperatures: jax.Array, steps: jax.Array, sample: bool
) -> tuple[jax.Array, jax.Array]:
  """Greedy or Gumbel-max sampled tokens and their probabilities (the AR and MDM baselines).

  Gumbel-max on `logits + temperature * gumbel` samples from
  softmax(logits / temperature), which is what LLaDA's `add_gumbel_noise`
  computes in another form. The noise is `row_gumbel_noise` (keyed by prompt
  and step), as the ReFusion decoder's. The returned
  probability is that of the chosen token under the un-noised softmax
  (LLaDA's confidence).

  Args:
    logits: [batch, length, vocab] float32.
    keys, temperatures, steps: [batch] each row's prompt's noise key and temperature (0: greedy), and its step.
    sample: False for greedy (argmax, first maximum) whatever the temperatures; a static switch.

  Returns:
    tokens [batch, length] int32 and their probabilities [batch, length] float32.
  """
  scores = logits
  if sample:
    scores = logits + sampling_noise(keys, temperatures, steps, logits.shape[1:])
  tokens = first_argmax(scores)
  return tokens, token_probs(logits, log_partition(logits), tokens)
