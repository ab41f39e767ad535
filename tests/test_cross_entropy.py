"""The chunked cross entropy against the dense one, and that it never holds [batch, length, vocab] logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from refusion_jax.parallel.compiled import sub_jaxprs
from refusion_jax.training.cross_entropy import weighted_cross_entropy

BATCH, LENGTH, EMBED, VOCAB = 3, 40, 16, 96


def random_inputs(seed):
  """hidden [B, T, E], head [E, V], labels [B, T], weights [2, B, T] (many zeros, as in training)."""
  keys = jax.random.split(jax.random.key(seed), 5)
  hidden = jax.random.normal(keys[0], (BATCH, LENGTH, EMBED), jnp.float32)
  head = jax.random.normal(keys[1], (EMBED, VOCAB), jnp.float32)
  labels = jax.random.randint(keys[2], (BATCH, LENGTH), 0, VOCAB)
  weights = jax.random.uniform(keys[3], (2, BATCH, LENGTH)) * jax.random.bernoulli(keys[4], 0.6, (2, BATCH, LENGTH))
  return hidden, head, labels, weights


def loss(hidden, head, labels, weights, chunk):
  """A scalar mixing both weightings, so that gradients see each."""
  sums = weighted_cross_entropy(lambda h: h @ head, hidden, labels, weights, chunk=chunk)
  return sums[0] + 0.3 * sums[1]


def dense_numpy(hidden, head, labels, weights):
  logits = np.asarray(hidden, np.float64) @ np.asarray(head, np.float64)
  log_probs = logits - logits.max(-1, keepdims=True)
  log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
  ce = -np.take_along_axis(log_probs, np.asarray(labels)[..., None], -1)[..., 0]
  return (ce[None] * np.asarray(weights, np.float64)).sum((1, 2))


@pytest.mark.parametrize("chunk", [0, 7, 8, 40, 64])  # dense, a padded last chunk, whole chunks, one, longer
def test_sums_match_a_float64_reference(chunk):
  hidden, head, labels, weights = random_inputs(chunk)
  sums = jax.jit(weighted_cross_entropy, static_argnums=0, static_argnames="chunk")(
    lambda h: h @ head, hidden, labels, weights, chunk=chunk
  )
  np.testing.assert_allclose(sums, dense_numpy(hidden, head, labels, weights), rtol=2e-6)


@pytest.mark.parametrize("chunk", [7, 8])
def test_gradients_equal_the_dense_ones(chunk):
  inputs = random_inputs(100 + chunk)
  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnames="chunk")
  (dense_value, dense_grads), (value, grads) = grad(*inputs, chunk=0), grad(*inputs, chunk=chunk)
  np.testing.assert_allclose(value, dense_value, rtol=1e-6)
  for chunked_grad, dense_grad in zip(grads, dense_grads):
    np.testing.assert_allclose(chunked_grad, dense_grad, rtol=1e-5, atol=1e-6)


def _largest_vocab_array(jaxpr) -> int:
  """Elements of the largest value with a vocabulary axis anywhere in a jaxpr, sub-jaxprs included."""
  largest = 0
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      shape = getattr(var.aval, "shape", ())
      if VOCAB in shape:
        largest = max(largest, int(np.prod(shape)))
    for sub in sub_jaxprs(eqn.params.values()):
      largest = max(largest, _largest_vocab_array(sub))
  return largest


def test_backward_pass_holds_one_chunk_of_logits_at_a_time():
  inputs = random_inputs(3)
  chunked = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)), static_argnums=4)(*inputs, 8).jaxpr
  dense = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)), static_argnums=4)(*inputs, 0).jaxpr
  assert _largest_vocab_array(dense) == BATCH * LENGTH * VOCAB  # the check sees the dense logits
  assert _largest_vocab_array(chunked) == BATCH * 8 * VOCAB
