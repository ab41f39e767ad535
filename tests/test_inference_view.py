"""Decoding a model built for training: remat on, layers scanned, float32 master weights with bfloat16 compute."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.decode_cases import random_weights

import refusion_jax as rj
from refusion_jax.decoding.reference import decode_reference
from refusion_jax.decoding.sampler import Sampler
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import inference_view, init_model

VOCAB, MASK, EOS = 64, 63, 5
FIELDS = dict(gen_length=16, slot_size=4, serial_blocks=2, slot_threshold=0.3, token_threshold=0.2)
METHOD = rj.ReFusion(**FIELDS)


def with_remat(model, remat: str, scan_layers: bool = False):
  """The same parameter arrays under a config whose only changes are `remat` and `scan_layers`."""
  twin = nnx.eval_shape(lambda: init_model(model.config.replace(remat=remat, scan_layers=scan_layers)))
  graphdef, _ = nnx.split(twin)
  return nnx.merge(graphdef, nnx.state(model))


@pytest.fixture(scope="module")
def models():
  rng = np.random.default_rng(0)
  template = init_model(tiny(vocab_size=VOCAB, mask_token_id=MASK, eos_token_id=EOS))
  plain = random_weights(template, seed=int(rng.integers(1 << 30)), weight_std=0.3, head_std=0.8)
  prompts = [rng.integers(0, VOCAB - 1, int(n)).tolist() for n in (3, 9, 14)]
  return plain, with_remat(plain, "full", scan_layers=True), prompts


def test_remat_model_decodes_to_the_tokens_of_the_remat_free_one(models):
  plain, remat, prompts = models
  assert (remat.config.remat, plain.config.remat) == ("full", "none") and remat.config.scan_layers
  decoders = {
    "refusion": lambda m: rj.decode(m, prompts, METHOD).tokens,
    "ar": lambda m: rj.decode(m, prompts, rj.AR(gen_length=12)).tokens,
    "mdm": lambda m: rj.decode(m, prompts, rj.MDM(gen_length=8, block_length=4, steps=4)).tokens,
    "reference": lambda m: decode_reference(m, prompts[1], mask_id=MASK, eos_id=EOS, **FIELDS).tokens,
    "sampler": lambda m: Sampler(m, "bytes", METHOD, mask_id=MASK, eos_id=EOS, pad_id=0).decode_ids(prompts).tokens,
  }
  for name, decode in decoders.items():
    expected = decode(plain)
    assert decode(remat) == expected, name
    assert any(len(row) > 1 for row in expected), f"{name}: degenerate decode"


def test_view_shares_the_arrays_when_nothing_is_cast(models):
  _, remat, _ = models
  view = inference_view(remat)
  assert (view.config.remat, view.config.scan_layers) == ("none", False)
  assert view.config.param_dtype == remat.config.param_dtype
  assert view.lm_head.get_value() is remat.lm_head.get_value()
  assert view.layers[1].self_attn.q_proj.get_value() is remat.layers[1].self_attn.q_proj.get_value()
  assert view.layers[0].self_attn.config == view.config  # the attention reads the view's config too
  assert inference_view(view) is view
  assert remat.config.remat == "full" and remat.config.scan_layers  # the training model is left as it was


def test_wide_weights_are_cast_once_to_the_compute_dtype(models):
  plain, _, prompts = models
  mixed = with_remat(plain, "full")
  graphdef, state = nnx.split(mixed)
  mixed = nnx.merge(graphdef, state)
  for module in (mixed, *(layer.self_attn for layer in mixed.layers)):
    module.config = mixed.config.replace(dtype="bfloat16")
  view = inference_view(mixed)
  dtypes = {leaf.dtype for leaf in jax.tree.leaves(nnx.state(view))}
  assert dtypes == {jnp.dtype(jnp.bfloat16)} and view.config.param_dtype == "bfloat16"
  assert {leaf.dtype for leaf in jax.tree.leaves(nnx.state(mixed))} == {jnp.dtype(jnp.float32)}
  assert inference_view(view) is view  # nothing left to cast: decoders reuse it as it is
  # Casting once outside the decoder gives the tokens of casting at every use inside it.
  assert rj.decode(view, prompts, METHOD).tokens == rj.decode(mixed, prompts, METHOD).tokens
  np.testing.assert_array_equal(
    np.asarray(view.lm_head.get_value()), np.asarray(plain.lm_head.get_value().astype(jnp.bfloat16))
  )
