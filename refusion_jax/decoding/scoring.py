"""The decoders' reads of the logits: the first maximum, token probabilities without a softmax, Gumbel noise,
the sampling filters and the log-probability of a drawn token.

Sampling is Gumbel-max with noise keyed by (prompt, step), so a sampled
decode is the same whichever row decodes a prompt and however the rows of a
batch advance (docs/method.md §4). What a row draws from (docs/sampling.md,
"Sampling fields"): softmax(logits / temperature) cut by top_k, top_p and
min_p in that order and renormalised; temperature 0 is greedy, and a greedy
token's log-probability is read under the model's own softmax.
"""

from __future__ import annotations

import flax.struct
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


def token_logprobs(logits: jax.Array, log_z: jax.Array, tokens: jax.Array) -> jax.Array:
  """Log-softmax of given tokens: logits[b, t, tokens[b, t]] - log_z[b, t].

  Args:
    logits: [batch, length, vocab]; log_z: [batch, length] from `log_partition`;
    tokens: [batch, length] int ids.

  Returns:
    [batch, length] float32.
  """
  picked = jnp.take_along_axis(logits, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return picked.astype(jnp.float32) - log_z


def token_probs(logits: jax.Array, log_z: jax.Array, tokens: jax.Array) -> jax.Array:
  """Softmax probabilities of given tokens: exp(`token_logprobs`), [batch, length] float32."""
  return jnp.exp(token_logprobs(logits, log_z, tokens))


@flax.struct.dataclass
class SamplingRule:
  """The distribution each row draws from (traced, each field [B]; no recompilation for new values).

  temperature: float32, 0 = greedy (filters ignored)
  top_k:       int32 keep the k most likely tokens, 0 = off
  top_p:       float32 keep the smallest most-likely set of mass >= top_p (after top_k), 1 = off
  min_p:       float32 keep tokens of probability >= min_p x the most likely one's, 0 = off
  """

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  min_p: jax.Array

  @classmethod
  def greedy(cls, rows: int) -> SamplingRule:
    return cls(
      temperature=jnp.zeros((rows,), jnp.float32),
      top_k=jnp.zeros((rows,), jnp.int32),
      top_p=jnp.ones((rows,), jnp.float32),
      min_p=jnp.zeros((rows,), jnp.float32),
    )


def _per_row(x: jax.Array, ndim: int) -> jax.Array:
  """[B] -> [B, 1, ...] broadcastable against an array of `ndim` dimensions."""
  return x.reshape(-1, *(1,) * (ndim - 1))


def tempered(logits: jax.Array, temperature: jax.Array) -> jax.Array:
  """logits / temperature per row (the raw logits on greedy rows), float32: [B, L, V], [B] -> [B, L, V]."""
  t = _per_row(temperature, logits.ndim)
  logits = logits.astype(jnp.float32)
  return jnp.where(t > 0, logits / jnp.where(t > 0, t, 1.0), logits)


def filter_floor(logits: jax.Array, rule: SamplingRule) -> jax.Array:
  """[B, L, V] -> [B, L] float32: the smallest tempered logit each row's filters keep (-inf: all are kept).

  Every filter keeps the tokens at or above some tempered logit, so one floor per position states them all and
  the [B, L, V] mask is never kept. The sort over the vocabulary runs only in calls where some sampling row
  filters.
  """
  length = logits.shape[1]

  def floor() -> jax.Array:
    z = jnp.sort(tempered(logits, rule.temperature), axis=-1)[..., ::-1]  # most likely first
    vocab = z.shape[-1]
    k = _per_row(jnp.where(rule.top_k > 0, jnp.minimum(rule.top_k, vocab), vocab), 3)
    in_k = jnp.arange(vocab) < k
    p = jax.nn.softmax(jnp.where(in_k, z, -jnp.inf), axis=-1)
    before = jnp.cumsum(p, axis=-1) - p  # the mass of the more likely tokens
    kept = jnp.sum(in_k & (before < _per_row(rule.top_p, 3)), axis=-1)  # >= 1: the first has none before it
    nucleus = jnp.take_along_axis(z, (kept - 1)[..., None], axis=-1)[..., 0]
    # min_p: p >= min_p * p_max, i.e. z >= z_max + log(min_p) (log 0 = -inf: off)
    floor = jnp.maximum(nucleus, z[..., 0] + jnp.log(_per_row(rule.min_p, 2)))
    return jnp.where(_per_row(rule.temperature, 2) > 0, floor, -jnp.inf)

  filters = (rule.top_k > 0) | (rule.top_p < 1) | (rule.min_p > 0)
  none = lambda: jnp.full((logits.shape[0], length), -jnp.inf, jnp.float32)
  return jax.lax.cond(jnp.any((rule.temperature > 0) & filters), floor, none)


def draw(logits: jax.Array, noise: jax.Array, rule: SamplingRule, floor: jax.Array) -> jax.Array:
  """[B, L] int32 tokens drawn by Gumbel-max: the first maximum of the kept logits (`filter_floor`) +
  temperature-scaled noise (`sampling_noise`; exact zeros on greedy rows, whose draw is the argmax)."""
  kept = tempered(logits, rule.temperature) >= floor[..., None]
  return first_argmax(jnp.where(kept, logits, -jnp.inf) + noise)


def policy_logprobs(logits: jax.Array, tokens: jax.Array, rule: SamplingRule, floor: jax.Array) -> jax.Array:
  """[B, L] float32 log-probabilities of `tokens` [B, L] under what each row draws from: the tempered softmax
  over the kept tokens (-inf for a token outside them); greedy rows: the model's own log-softmax."""
  z = tempered(logits, rule.temperature)
  log_z = jax.nn.logsumexp(jnp.where(z >= floor[..., None], z, -jnp.inf), axis=-1)
  picked = jnp.take_along_axis(z, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return jnp.where(picked >= floor, picked - log_z, -jnp.inf)


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
  logits: jax.Array, keys: jax.Array, rule: SamplingRule, steps: jax.Array, sample: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Greedy or Gumbel-max sampled tokens, their probabilities and log-probabilities (the AR and MDM baselines).

  Gumbel-max on `logits + temperature * gumbel` samples from
  softmax(logits / temperature), which is what LLaDA's `add_gumbel_noise`
  computes in another form; the filters of `rule` cut that distribution first.
  The noise is `row_gumbel_noise` (keyed by prompt and step), as the ReFusion
  decoder's. The returned probability is that of the chosen token under the
  un-noised softmax (LLaDA's confidence); the log-probability is under what
  the row draws from (`policy_logprobs`).

  Args:
    logits: [batch, length, vocab] float32.
    keys, steps: [batch] each row's prompt's noise key and its step; rule: each row's `SamplingRule`.
    sample: False for greedy (argmax, first maximum) whatever the temperatures; a static switch.

  Returns:
    tokens [batch, length] int32, their probabilities and their log-probabilities [batch, length] float32.
  """
  log_z = log_partition(logits)
  if not sample:  # every row greedy: the policy is the model's own softmax, whose partition is log_z
    tokens = first_argmax(logits)
    logprobs = token_logprobs(logits, log_z, tokens)
    return tokens, jnp.exp(logprobs), logprobs
  noise = sampling_noise(keys, rule.temperature, steps, logits.shape[1:])
  floor = filter_floor(logits, rule)
  tokens = draw(logits, noise, rule, floor)
  return tokens, token_probs(logits, log_z, tokens), policy_logprobs(logits, tokens, rule, floor)
