"""Every `attention_impl` gives the default path's logits and gradients, with a cache and arbitrary masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from refusion_jax.model import cache as kv_cache
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import init_model

VOCAB, BLOCK, CAPACITY, BATCH = 97, 13, 11, 3


@nnx.jit
def forward(model, *args):
  return model(*args)


def model_with(impl: str, **overrides):
  # The implementation does not enter the initialisation: one seed, the same weights.
  return init_model(tiny(vocab_size=VOCAB, attention_impl=impl, **overrides), seed=4)


def random_inputs(seed: int):
  """Tokens, positions, a random mask (fully masked rows included) and a partly filled random cache."""
  rng = np.random.default_rng(seed)
  config = tiny(vocab_size=VOCAB)
  tokens = jnp.asarray(rng.integers(0, VOCAB, (BATCH, BLOCK)), jnp.int32)
  positions = jnp.asarray(rng.permutation(BLOCK + CAPACITY)[None, :BLOCK].repeat(BATCH, 0), jnp.int32)
  mask = rng.random((BATCH, BLOCK, CAPACITY + BLOCK)) < 0.5
  mask[0, 2] = False  # a query that sees nothing
  cache = kv_cache.KVCache.create(config, BATCH, CAPACITY)
  shape = cache.k.shape
  fill = rng.integers(0, CAPACITY + 1, BATCH)
  cache = cache.replace(
    k=jnp.asarray(rng.normal(size=shape), jnp.float32),
    v=jnp.asarray(rng.normal(size=shape), jnp.float32),
    valid=jnp.asarray(np.arange(CAPACITY)[None] < fill[:, None]),
  )
  return tokens, positions, jnp.asarray(mask), cache


# "auto" and "flash" fuse only training forwards (segment ids): masked and cached forwards take the dense path.
@pytest.mark.parametrize(
  "impl, chunk", [("chunked", 4), ("chunked", 5), ("chunked", 64), ("dot_product", 512), ("auto", 512), ("flash", 512)]
)
def test_logits_and_block_kv_match_the_dense_path(impl, chunk):
  seed = int(np.random.default_rng().integers(1 << 16))
  tokens, positions, mask, cache = random_inputs(seed)
  dense, other = model_with("xla"), model_with(impl, attention_chunk=chunk)
  for with_cache in (True, False):
    args = (tokens, positions, mask, cache) if with_cache else (tokens, positions, mask[:, :, CAPACITY:])
    want_logits, want_kv = forward(dense, *args)
    got_logits, got_kv = forward(other, *args)
    np.testing.assert_allclose(got_logits, want_logits, rtol=2e-5, atol=2e-5, err_msg=f"seed {seed}")
    # The first layer's keys come before any attention: equal. Later layers' keys take the attention
    # output's rounding (up to 1.5e-6 over 60 seeds; a bound of 1e-6 failed now and then), as logits do.
    np.testing.assert_array_equal(got_kv.k[0], want_kv.k[0], err_msg=f"seed {seed}")
    np.testing.assert_allclose(got_kv.k, want_kv.k, rtol=2e-5, atol=2e-5, err_msg=f"seed {seed}")


def test_chunked_gradients_match_the_dense_path():
  seed = int(np.random.default_rng().integers(1 << 16))
  tokens, positions, _, _ = random_inputs(seed)
  labels = jnp.roll(tokens, -1, axis=1)

  def grads(model):
    def loss(model):
      logits, _ = model(tokens, positions)  # the causal default, as in training
      return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0])

    return nnx.jit(nnx.grad(loss))(model)

  want = grads(model_with("xla", remat="full"))
  got = grads(model_with("chunked", attention_chunk=4, remat="full"))
  for (path, a), (_, b) in zip(nnx.to_flat_state(want), nnx.to_flat_state(got)):
    np.testing.assert_allclose(b.get_value(), a.get_value(), rtol=1e-4, atol=1e-6, err_msg=f"{path} seed {seed}")


def test_unknown_implementation_is_named():
  with pytest.raises(ValueError, match="attention_impl='splash'"):
    tiny(attention_impl="splash")
  with pytest.raises(ValueError, match="attention_chunk=0"):
    tiny(attention_chunk=0)
