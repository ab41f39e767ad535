"""The AR and MDM baselines against naive eager transcriptions on a tiny random model."""

import numpy as np
import pytest
from helpers.eager_baselines import llada_low_confidence, naive_greedy

import refusion_jax as rj
from refusion_jax.decoding.loop import compile_count
from refusion_jax.decoding.mdm import num_transfer_tokens
from refusion_jax.decoding.result import PHASE_NONE, PHASE_STEP
from refusion_jax.model import config
from refusion_jax.model import transformer as model_lib

MASK_ID = 255


@pytest.fixture(scope="module")
def model():
  m = model_lib.init_model(config.tiny(mask_token_id=MASK_ID), seed=3)
  # Random init gives near-uniform logits; a larger head spreads them so greedy
  # choices are far from float ties between the cached and uncached forwards.
  m.lm_head[...] = m.lm_head[...] * 40.0
  return m


def random_prompts(seed, lengths, vocab=200):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


def test_ar_greedy_matches_naive_loop_for_a_ragged_batch(model):
  prompts = random_prompts(0, [5, 1, 12, 20])
  result = rj.decode(model, prompts, rj.AR(gen_length=10))
  for row, prompt in enumerate(prompts):
    assert result.tokens[row] == naive_greedy(model, prompt, 10)


def test_ar_rows_stop_at_their_own_eos(model):
  prompts = random_prompts(1, [7, 3, 9])
  free = [naive_greedy(model, p, 12) for p in prompts]
  eos_id = free[0][3]
  result = rj.decode(model, prompts, rj.AR(gen_length=12), eos_id=eos_id)
  for row, prompt in enumerate(prompts):
    expected = naive_greedy(model, prompt, 12, eos_id=eos_id)
    assert result.tokens[row] == expected
    # The prefill yields the first token, each later token costs one forward.
    assert result.num_forwards[row] == len(expected)
    assert list(result.commit_iteration[row, : len(expected)]) == list(range(len(expected)))
    assert (result.commit_iteration[row, len(expected) :] == -1).all()
    assert (result.commit_phase[row, : len(expected)] == PHASE_STEP).all()
    assert (result.commit_phase[row, len(expected) :] == PHASE_NONE).all()
  assert len(result.tokens[0]) == free[0].index(eos_id) + 1


def test_ar_without_eos_costs_one_forward_per_token(model):
  result = rj.decode(model, random_prompts(2, [4, 6]), rj.AR(gen_length=9))
  assert [len(t) for t in result.tokens] == [9, 9]
  assert result.num_forwards.tolist() == [9, 9]
  assert result.overall_tpf == pytest.approx(1.0)


def test_ar_sampling_is_reproducible_per_seed():
  prompts = random_prompts(3, [6, 11])
  hot = model_lib.init_model(config.tiny(mask_token_id=MASK_ID), seed=4)  # flat logits: samples vary
  method = rj.AR(gen_length=16, temperature=1.0)
  first = rj.decode(hot, prompts, method, seed=7)
  again = rj.decode(hot, prompts, method, seed=7)
  other = rj.decode(hot, prompts, method, seed=8)
  assert first.tokens == again.tokens
  assert first.tokens != other.tokens


@pytest.mark.parametrize("gen_length,block_length,steps", [(8, 8, 8), (12, 4, 6), (12, 6, 4)])
def test_mdm_matches_llada_transcription(model, gen_length, block_length, steps):
  prompts = random_prompts(4, [6, 2, 13])
  result = rj.decode(model, prompts, rj.MDM(gen_length, block_length=block_length, steps=steps))
  for row, prompt in enumerate(prompts):
    assert result.tokens[row] == llada_low_confidence(model, prompt, gen_length, block_length, steps, MASK_ID)
  assert result.num_forwards.tolist() == [steps] * len(prompts)


def test_mdm_unmasks_the_schedule_per_step_and_cuts_after_eos(model):
  prompts = random_prompts(5, [8])
  method = rj.MDM(gen_length=12, block_length=4, steps=6)
  free = rj.decode(model, prompts, method)
  counts = np.bincount(free.commit_iteration[0], minlength=6)
  assert counts.tolist() == [2] * 6  # 4 tokens per block over 2 steps each
  eos_id = free.tokens[0][5]
  cut = rj.decode(model, prompts, method, eos_id=eos_id)
  first = free.tokens[0].index(eos_id)
  assert cut.tokens[0] == free.tokens[0][: first + 1]
  assert (cut.commit_iteration[0, first + 1 :] == -1).all()


def test_mdm_sampling_is_reproducible_per_seed():
  prompts = random_prompts(6, [5, 9])
  method = rj.MDM(gen_length=8, block_length=4, steps=4, temperature=1.0)
  hot = model_lib.init_model(config.tiny(mask_token_id=MASK_ID), seed=5)
  first = rj.decode(hot, prompts, method, seed=1)
  assert first.tokens == rj.decode(hot, prompts, method, seed=1).tokens
  assert first.tokens != rj.decode(hot, prompts, method, seed=2).tokens


def test_num_transfer_tokens_gives_the_remainder_to_the_first_steps():
  assert num_transfer_tokens(10, 4).tolist() == [3, 3, 2, 2]
  assert num_transfer_tokens(8, 8).tolist() == [1] * 8


def test_new_prompts_in_one_bucket_do_not_recompile(model):
  rj.decode(model, random_prompts(7, [3, 4]), rj.AR(gen_length=5))
  before = compile_count("ar")
  rj.decode(model, random_prompts(8, [9, 2]), rj.AR(gen_length=5))
  assert compile_count("ar") == before


@pytest.mark.parametrize(
  "fields,options,message",
  [
    (dict(gen_length=10, block_length=4, steps=4), {}, "multiple of block_length"),
    (dict(gen_length=8, block_length=4, steps=3), {}, "multiple of the number of blocks"),
    (dict(gen_length=8, block_length=4, steps=16), {}, "at most steps=8"),
    (dict(gen_length=8, block_length=4, steps=4, temperature=-1.0), {}, "temperature"),
    (dict(gen_length=8, block_length=4, steps=4), dict(mask_id=999), "mask_id=999"),
  ],
)
def test_mdm_rejects_bad_arguments(model, fields, options, message):
  with pytest.raises(ValueError, match=message):
    rj.decode(model, [[1, 2, 3]], rj.MDM(**fields), **options)


def test_mdm_needs_a_mask_id():
  plain = model_lib.init_model(config.tiny(), seed=0)
  with pytest.raises(ValueError, match="mask_id"):
    rj.decode(plain, [[1, 2]], rj.MDM(gen_length=4, block_length=4, steps=4))


def test_ar_rejects_bad_prompts(model):
  with pytest.raises(ValueError, match="list of lists"):
    rj.decode(model, [1, 2, 3], rj.AR(gen_length=4))
  with pytest.raises(ValueError, match="outside the vocabulary"):
    rj.decode(model, [[1, 300]], rj.AR(gen_length=4))
