"""The LM head's cross entropy without [batch, length, vocab] logits (the loss of docs/method.md §1 step 5).

`weighted_cross_entropy` returns, for several weightings of the same tokens,
the sum of CE x weight. With `chunk > 0` it walks the *length* axis `chunk`
tokens at a time in a `lax.scan`: each step projects its hidden states to
float32 logits [batch, chunk, vocab], takes the CE and the weighted sums, and
is rematerialised in the backward pass (`jax.checkpoint`). So one chunk's
logits (and their gradient) exist at a time, forward and backward, instead of
the whole batch's, at the price of projecting every chunk twice. The batch
axis is never split: rows stay sharded over `data` / `fsdp` as the batch is,
and the vocabulary over `tensor` as the head is.

`chunk <= 0`, or a chunk at least as long as the rows, is the dense reference:
every logit at once, as before.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax


def _weighted_sums(
  logits_fn: Callable[[jax.Array], jax.Array], hidden: jax.Array, labels: jax.Array, weights: jax.Array
) -> jax.Array:
  """[kinds] sums of CE x weights over a [batch, n] block of tokens (shapes as in `weighted_cross_entropy`)."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits_fn(hidden).astype(jnp.float32), labels)
  return jnp.sum(ce[None] * weights, axis=(1, 2))


def _split(x: jax.Array, axis: int, chunk: int) -> jax.Array:
  """Length axis `axis` (a multiple of `chunk`) -> [chunks, ..., chunk, ...] with the chunks leading."""
  shape = x.shape[:axis] + (x.shape[axis] // chunk, chunk) + x.shape[axis + 1 :]
  return jnp.moveaxis(x.reshape(shape), axis, 0)


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
  length = hidden.shape[1]
  if chunk <= 0 or length <= chunk:
    return _weighted_sums(logits_fn, hidden, labels, weights)
  pad = -length % chunk  # padded tokens weigh 0
  hidden = jnp.pad(hidden, [(0, 0), (0, pad), (0, 0)])
  labels = jnp.pad(labels, [(0, 0), (0, pad)])
  weights = jnp.pad(weights, [(0, 0), (0, 0), (0, pad)])
  # prevent_cse=False: inside a scan, CSE cannot undo the rematerialisation.
  step = jax.checkpoint(lambda h, y, w: _weighted_sums(logits_fn, h, y, w), prevent_cse=False)

  def accumulate(total: jax.Array, block: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, None]:
    return total + step(*block), None

  blocks = (_split(hidden, 1, chunk), _split(labels, 1, chunk), _split(weights, 2, chunk))
  total, _ = jax.lax.scan(accumulate, jnp.zeros(weights.shape[:1], jnp.float32), blocks)
  return total
