"""How close our logits are to a reference's: the one measure every parity and cache test uses; and whether two
ways of running the same LoRA model (unrolled and scanned, plain and rematerialised) train its adapters alike."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from refusion_jax.model import lora


def assert_logits_close(ours, reference, tolerance: float) -> None:
  """Every |ours - reference| <= tolerance * max |reference| (chex names the worst entries when not)."""
  reference = np.asarray(reference, np.float64)
  chex.assert_trees_all_close(np.asarray(ours, np.float64), reference, rtol=0, atol=tolerance * np.abs(reference).max())


def relative_error(ours, reference) -> float:
  """max |ours - reference| / max |reference|."""
  ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
  return float(np.abs(ours - reference).max() / np.abs(reference).max())


def adapter_loss(graphdef: nnx.GraphDef, trainable: nnx.State, frozen: nnx.State, tokens: jax.Array) -> jax.Array:
  """A loss of the model (graphdef, trainable adapters, frozen rest) on `tokens` that reaches every logit."""
  logits, _ = nnx.merge(graphdef, trainable, frozen)(tokens)
  return jnp.mean(jax.nn.log_softmax(logits)[..., 0])


def assert_same_adapter_gradients(graphdef: nnx.GraphDef, variant: nnx.GraphDef, state: nnx.State, tokens) -> None:
  """`state` run by `graphdef` and by `variant` gives the same loss and finite, equal adapter gradients."""
  trainable, frozen = lora.trainable_part(state)
  value_and_grad = jax.value_and_grad(adapter_loss, argnums=1)
  loss, grads = value_and_grad(graphdef, trainable, frozen, tokens)
  loss_v, grads_v = value_and_grad(variant, trainable, frozen, tokens)
  np.testing.assert_allclose(float(loss_v), float(loss), atol=1e-6)
  for g, g_v in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_v)):
    assert np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_allclose(np.asarray(g_v), np.asarray(g), atol=1e-5)
