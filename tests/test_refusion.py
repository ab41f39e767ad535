"""ReFusion decoder behaviour: hand-built cases with a known outcome, compilation, sampling, input checks."""

import dataclasses

import numpy as np
import pytest
from helpers.decode_cases import random_weights
from helpers.hand_cases import EOS, HAND_CASES, MASK, WORD, bigram_model, hand_knobs

import refusion_jax as rj
from refusion_jax.data.tokenizer import ByteTokenizer
from refusion_jax.decoding.loop import compile_count
from refusion_jax.decoding.methods import METHODS
from refusion_jax.decoding.reference import decode_reference
from refusion_jax.decoding.sampler import Sampler
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import init_model


@pytest.mark.parametrize("name", HAND_CASES)
def test_hand_built_model_decodes_as_derived(name):
  case = HAND_CASES[name]
  model = bigram_model(*case["model"])
  knobs = hand_knobs(case)
  prompts = [[2, 3, 4], [5] * 20]  # the prompt is invisible to this model: both rows decode alike
  result = rj.decode(model, prompts, rj.ReFusion(**knobs))
  reference = decode_reference(model, prompts[0], mask_id=MASK, eos_id=EOS, **knobs)
  for got in (result, reference):
    for row in range(len(got.tokens)):
      assert got.tokens[row] == case["tokens"]
      assert got.num_forwards[row] == case["forwards"][0]
      assert got.steps[row] == case["steps"][0]
      assert got.commit_iteration[row].tolist() == case["iteration"]
      assert got.commit_phase[row].tolist() == case["phase"]


FIELDS = dict(gen_length=8, slot_size=2, serial_blocks=2, slot_threshold=0.6, token_threshold=0.4)
METHOD = rj.ReFusion(**FIELDS)
IDS = dict(mask_id=15, eos_id=14)


def random_model(seed: int, head_std: float = 0.5):
  return random_weights(init_model(tiny(vocab_size=16)), seed, weight_std=0.2, head_std=head_std)


def test_new_prompts_and_weights_in_one_bucket_compile_once():
  rng = np.random.default_rng(0)
  method = dataclasses.replace(METHOD, gen_length=12, slot_size=3)  # a layout no other test compiles
  before = compile_count("refusion")
  rj.decode(random_model(0), [rng.integers(0, 14, 3).tolist()], method, **IDS)
  assert compile_count("refusion") == before + 1
  for index in range(10):
    prompt = rng.integers(0, 14, int(rng.integers(1, 17))).tolist()
    threshold = float(rng.uniform(0.1, 0.9))
    rj.decode(random_model(index + 1), [prompt], dataclasses.replace(method, slot_threshold=threshold), **IDS)
  assert compile_count("refusion") == before + 1


def test_sampling_is_reproducible_per_seed():
  model = random_model(1, head_std=0.05)  # nearly flat logits: samples vary a lot
  prompts = [[1, 2, 3], [4, 5]]
  method = dataclasses.replace(METHOD, temperature=1.0)
  sample = lambda seed: rj.decode(model, prompts, method, **IDS, seed=seed).tokens
  first = sample(7)
  assert sample(7) == first
  assert any(sample(seed) != first for seed in (8, 9, 10))


def test_batched_rows_equal_their_single_calls():
  rng = np.random.default_rng(3)
  for case in range(3):
    model = random_model(100 + case, head_std=float(rng.uniform(0.2, 1.5)))
    prompts = [rng.integers(0, 14, int(n)).tolist() for n in (2, 9, 16, 5)]
    method = dataclasses.replace(METHOD, token_threshold=float(rng.uniform(0.1, 0.9)))
    ids = dict(IDS, eos_id=int(rng.integers(0, 14)))
    batched = rj.decode(model, prompts, method, **ids)
    for row, prompt in enumerate(prompts):
      single = rj.decode(model, [prompt], method, **ids)
      assert batched.tokens[row] == single.tokens[0]
      assert batched.num_forwards[row] == single.num_forwards[0]
      np.testing.assert_array_equal(batched.commit_iteration[row], single.commit_iteration[0])


def test_defaults_come_from_the_model_config():
  model = bigram_model(WORD, WORD)
  method = rj.ReFusion(gen_length=8, slot_size=4, serial_blocks=1, slot_threshold=0.5, token_threshold=0.5)
  result = rj.decode(model, [[1, 2]], method)
  assert result.tokens == [[WORD] * 8]


BAD_INPUTS = [
  (dict(prompt_ids=[]), "non-empty list"),
  (dict(prompt_ids=[[1, 99]]), "outside the vocabulary"),
  (dict(gen_length=10), "use gen_length=8"),
  (dict(gen_length=3), "use gen_length=4"),
  (dict(slot_size=0), "slot_size=0"),
  (dict(serial_blocks=0), "serial_blocks=0"),
  (dict(slot_threshold=0.0), r"slot_threshold=0.0 must lie in \(0, 1\]"),
  (dict(token_threshold=1.5), r"token_threshold=1.5 must lie in \(0, 1\]"),
  (dict(temperature=-0.5), "temperature=-0.5 must be >= 0"),
  (dict(mask_id=None), "pass mask_id=..."),
  (dict(mask_id=16), "mask_id=16 lies outside"),
  (dict(eos_id=None), "pass eos_id=..."),
  (dict(eos_id=-1), "eos_id=-1 lies outside"),
  (dict(gen_length=4096), "maximum 4096"),
]


@pytest.mark.parametrize("change,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_is_rejected_before_compiling(change, message):
  model = init_model(tiny(vocab_size=16))  # no mask or EOS id in the config
  args = dict(FIELDS, **IDS, prompt_ids=[[1, 2, 3]])
  args.update(change)
  prompt_ids, ids = args.pop("prompt_ids"), {name: args.pop(name) for name in IDS}
  before = compile_count("refusion")
  with pytest.raises(ValueError, match=message):
    rj.decode(model, prompt_ids, rj.ReFusion(**args), **ids)
  assert compile_count("refusion") == before


NOT_INTEGER_IDS = {
  "floats": [[1.5, 2.0]],
  "whole floats": [[1.0, 2.0]],
  "one float among ints": [[1, 2.0, 3]],
  "float array": np.array([[4.0, 5.0]]),
  "bools": [[True, False]],
  "a bool among ints": [[3, True]],
  "bool array": np.array([[1, 0]], bool),
}


@pytest.mark.parametrize("ids", NOT_INTEGER_IDS.values(), ids=NOT_INTEGER_IDS)
def test_non_integer_token_ids_are_refused_by_every_decoder(ids):
  tok = ByteTokenizer()
  model = init_model(tiny(vocab_size=tok.vocab_size, mask_token_id=tok.mask_id, eos_token_id=tok.eos_id))
  refusion = rj.ReFusion(gen_length=8, slot_size=4, serial_blocks=1, slot_threshold=0.5, token_threshold=0.5)
  decoders = [
    lambda: rj.decode(model, ids, refusion),
    lambda: rj.decode(model, ids, rj.AR(gen_length=8)),
    lambda: rj.decode(model, ids, rj.MDM(gen_length=8, block_length=8, steps=8)),
    lambda: Sampler(model, tok, refusion).decode_ids(ids),
  ]
  before = [compile_count(method) for method in METHODS]
  for decode in decoders:
    with pytest.raises(ValueError, match="Prompt 0 must be a flat list of integer token ids"):
      decode()
  assert [compile_count(method) for method in METHODS] == before
