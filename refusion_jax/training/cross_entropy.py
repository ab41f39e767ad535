"""Per-token reads of the LM head without [batch, length, vocab] logits (the loss of docs/method.md §1 step 5).

`chunked_per_token` computes a per-token value of the logits (a cross entropy,
a log-probability) `chunk` tokens of length at a time: each step projects its
hidden states to float32 logits [batch, chunk, vocab], reads one value per
token, and is rematerialised in the backward pass (`jax.checkpoint`). So one
chunk's logits (and their gradient) exist at a time, forward and backward,
instead of the whole batch's, at the price of projecting every chunk twice.
The batch axis is never split: rows stay sharded over `data` / `fsdp` as the
batch is, and the vocabulary over `tensor` as the head is.

`weighted_cross_entropy` (the training loss) sums its cross entropy under
several weightings; the RL replay (refusion_jax.rl.replay) reads each token's
log-probability under the sampling policy.

`chunk <= 0`, or a chunk at least as long as the rows, is the dense reference:
every logit at once, as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax


def _cross_entropy(logits_fn: Callable[[jax.Array], jax.Array], hidden: jax.Array, labels: jax.Array) -> jax.Array:
  """[batch, n] CE of labels [batch, n] under the logits of hidden [batch, n, embed]."""
  return optax.softmax_cross_entropy_with_integer_labels(logits_fn(hidden).astype(jnp.float32), labels)


def _split(x: jax.Array, axis: int, chunk: int) -> jax.Array:
  """Length axis `axis` (a multiple of `chunk`) -> [chunks, ..., chunk, ...] with the chunks leading."""
  shape = x.shape[:axis] + (x.shape[axis] // chunk, chunk) + x.shape[axis + 1 :]
  return jnp.moveaxis(x.reshape(shape), axis, 0)


def chunked_per_token(
  token_fn: Callable[[jax.Array, jax.Array], jax.Array], hidden: jax.Array, labels: jax.Array, *, chunk: int
) -> jax.Array:
  """`token_fn(hidden, labels)` computed `chunk` tokens of length at a time, each chunk rematerialised.

  Args:
    token_fn: ([batch, n, embed] hidden, [batch, n] labels) -> [batch, n] float32, one value per token read
      from the logits it projects (e.g. a cross entropy); called on [batch, chunk] blocks. Per-row values it
      closes over ([batch]) stay whole: the chunks split length, never batch.
    hidden: [batch, length, embed] final-normed hidden states.
    labels: [batch, length] int target ids.
    chunk: tokens of length per step; <= 0 computes every logit at once.

  Returns:
    [batch, length] float32.
  """
  batch, length = labels.shape
  if chunk <= 0 or length <= chunk:
    return token_fn(hidden, labels)
  pad = -length % chunk  # padded tokens are computed and dropped
  hidden = jnp.pad(hidden, [(0, 0), (0, pad), (0, 0)])
  labels = jnp.pad(labels, [(0, 0), (0, pad)])
  # prevent_cse=False: inside a loop, CSE cannot undo the rematerialisation.
  step = jax.checkpoint(token_fn, prevent_cse=False)
  values = jax.lax.map(lambda block: step(*block), (_split(hidden, 1, chunk), _split(labels, 1, chunk)))
  return jnp.moveaxis(values, 0, 1).reshape(batch, length + pad)[:, :length]


def weighted_cross_entropy(
  logits_fn: Callable[[jax.Array], jax.Array],
  hidden: jax.Array,
  labels: jax.Array,
  weights: jax.Array,
  *,
  chunk: int,
) -> jax.Array:
  """Sum over tokens of the cross entropy times each weighting, `chunk` tokens of length at a time.

  Args:
    logits_fn: [batch, n, embed] hidden states -> [batch, n, vocab] logits
      (the model's `logits`); called on [batch, chunk, embed] blocks.
    hidden: [batch, length, embed] final-normed hidden states.
    labels: [batch, length] int target ids (any id where every weight is 0).
    weights: [kinds, batch, length] float32.
    chunk: tokens of length per scan step; <= 0 computes every logit at once.

  Returns:
    [kinds] float32: sum over batch and length of CE x weights[k].
  """
  ce = chunked_per_token(functools.partial(_cross_entropy, logits_fn), hidden, labels, chunk=chunk)
  return jnp.sum(ce[None] * weights, axis=(1, 2))
