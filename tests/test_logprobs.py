"""Per-token log-probabilities from the loop (`DecodeResult.logprobs`, `.rollout`), the sampling filters
(`scoring.SamplingRule`: top_k, top_p, min_p per request, no recompilation) and the speculative rule's basic
promises (docs/sampling.md, "Sampling fields" and "Log-probabilities"; docs/method.md §6). The exactness proof of
the speculative rule (enumeration, frequencies) is tests/test_rl_exactness.py, the replay's tests
tests/test_rl_replay.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.decode_cases import random_weights

import refusion_jax as rj
from refusion_jax.decoding.loop import compile_count
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import init_model

VOCAB = 48
MASK, EOS = VOCAB - 1, VOCAB - 2


@pytest.fixture(scope="module")
def model():
  return random_weights(init_model(tiny(vocab_size=VOCAB)), 11, 0.3, 0.8)


def _prompts(seed: int, count: int = 3) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(1, VOCAB - 2, size=int(rng.integers(3, 9))).tolist() for _ in range(count)]


def _causal_logprobs(model, prompt, answer, temperature):
  """Teacher-forced next-token log-probabilities of `answer` after `prompt` at `temperature` (0: untempered)."""
  ids = jnp.asarray([prompt + answer])
  length = ids.shape[1]
  logits, _ = model(ids, jnp.arange(length)[None], jnp.tril(jnp.ones((1, length, length), bool)))
  logits = logits[0, len(prompt) - 1 : length - 1].astype(jnp.float32)
  logits = logits / temperature if temperature > 0 else logits
  return np.asarray(jax.nn.log_softmax(logits)[jnp.arange(len(answer)), jnp.asarray(answer)])


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_ar_logprobs_equal_a_teacher_forced_forward(model, temperature):
  prompts = _prompts(1)
  result = rj.decode(
    model, prompts, rj.AR(gen_length=6, temperature=temperature), logprobs=True, mask_id=MASK, eos_id=EOS
  )
  for row, prompt in enumerate(prompts):
    answer = result.tokens[row]
    np.testing.assert_allclose(
      result.logprobs[row, : len(answer)], _causal_logprobs(model, prompt, answer, temperature), atol=1e-4
    )
    assert np.isnan(result.logprobs[row, len(answer) :]).all()


def test_mdm_logprobs_are_read_at_the_step_that_unmasked_each_token(model):
  prompt = _prompts(2, 1)[0]
  G = 4
  result = rj.decode(model, [prompt], rj.MDM(gen_length=G, block_length=G, steps=G), logprobs=True, mask_id=MASK)
  tokens, steps = np.array(result.rollout.tokens[0]), result.rollout.iteration[0]
  for step in range(G):
    answer = np.where((steps < step) & (steps >= 0), tokens, MASK)
    ids = jnp.asarray([prompt + answer.tolist()])
    length = ids.shape[1]
    logits, _ = model(ids, jnp.arange(length)[None], jnp.ones((1, length, length), bool))
    logprobs = jax.nn.log_softmax(logits[0, len(prompt) :].astype(jnp.float32))
    for position in np.flatnonzero(steps == step):
      expected = float(logprobs[position, tokens[position]])
      assert result.rollout.logprobs[0, position] == pytest.approx(expected, abs=1e-4)


def test_logprobs_are_off_unless_asked_and_cost_no_compilation(model):
  prompts = _prompts(3)
  method = rj.ReFusion(gen_length=8, slot_size=2, temperature=0.9, slot_threshold=0.5)
  plain = rj.decode(model, prompts, method, mask_id=MASK, eos_id=EOS)
  before = compile_count("refusion")
  asked = rj.decode(model, prompts, method, logprobs=True, mask_id=MASK, eos_id=EOS)
  assert compile_count("refusion") == before
  assert plain.logprobs is None and plain.rollout is None
  assert plain.tokens == asked.tokens
  for row, answer in enumerate(asked.tokens):
    values = asked.logprobs[row, : len(answer)]
    assert np.isfinite(values).all() and (values <= 1e-6).all()
    committed = asked.rollout.iteration[row] >= 0
    assert (asked.rollout.tokens[row][committed] >= 0).all()
    assert np.isfinite(asked.rollout.logprobs[row][committed]).all()
    assert asked.rollout.tokens[row][: len(answer)].tolist() == answer


def test_filters_per_request_share_one_program_and_cut_the_distribution(model):
  prompts = _prompts(4, 4)
  engine = rj.Engine(
    model, rj.AR(gen_length=6), rows=4, prompt_width=16, sampling=True, mask_id=MASK, eos_id=EOS, logprobs=True
  )
  greedy = rj.decode(model, prompts, rj.AR(gen_length=6), mask_id=MASK, eos_id=EOS, logprobs=True)

  def run(**fields):
    requests = [engine.submit(p, temperature=1.0, seed=i, **fields) for i, p in enumerate(prompts)]
    while not engine.idle:
      engine.advance()
    return requests

  run()  # compiles
  before = compile_count("ar")
  # top_k=1, a tiny top_p and min_p=1 each leave the most likely token only: greedy, with log-probability 0.
  for fields in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
    requests = run(**fields)
    result = engine.pop(requests)
    assert result.tokens == greedy.tokens, fields
    answered = ~np.isnan(result.logprobs)
    assert answered.sum() == sum(len(t) for t in result.tokens)
    np.testing.assert_allclose(result.logprobs[answered], 0.0, atol=1e-6)
  top2 = engine.pop(run(top_k=2))
  assert compile_count("ar") == before
  for row, prompt in enumerate(prompts):
    answer = top2.tokens[row]
    ids = jnp.asarray([prompt + answer])
    length = ids.shape[1]
    logits, _ = model(ids, jnp.arange(length)[None], jnp.tril(jnp.ones((1, length, length), bool)))
    ranks = np.argsort(-np.asarray(logits[0, len(prompt) - 1 : length - 1]), axis=-1)
    assert all(token in ranks[i, :2] for i, token in enumerate(answer))


def test_filtered_logprobs_are_renormalised_over_the_kept_tokens(model):
  prompts = _prompts(5, 2)
  engine = rj.Engine(
    model, rj.AR(gen_length=5), rows=2, prompt_width=16, sampling=True, mask_id=MASK, eos_id=EOS, logprobs=True
  )
  requests = [engine.submit(p, temperature=0.8, top_k=3, seed=i) for i, p in enumerate(prompts)]
  while not engine.idle:
    engine.advance()
  result = engine.pop(requests)
  for row, prompt in enumerate(prompts):
    answer = result.tokens[row]
    ids = jnp.asarray([prompt + answer])
    length = ids.shape[1]
    logits, _ = model(ids, jnp.arange(length)[None], jnp.tril(jnp.ones((1, length, length), bool)))
    z = np.asarray(logits[0, len(prompt) - 1 : length - 1], np.float64) / 0.8
    kept = z >= np.sort(z, axis=-1)[:, -3][:, None]
    z = np.where(kept, z, -np.inf)
    expected = z[np.arange(len(answer)), answer] - np.log(np.exp(z).sum(-1))
    np.testing.assert_allclose(result.logprobs[row, : len(answer)], expected, atol=1e-4)


def test_bad_filters_are_refused_by_name(model):
  engine = rj.Engine(model, rj.AR(gen_length=4), rows=1, prompt_width=8, sampling=True, mask_id=MASK, eos_id=EOS)
  for bad, message in (
    (dict(top_k=-1), "top_k=-1 must be an integer >= 0"),
    (dict(top_p=0.0), r"top_p=0.0 must lie in \(0, 1\]"),
    (dict(min_p=1.5), r"min_p=1.5 must lie in \[0, 1\]"),
  ):
    with pytest.raises(ValueError, match=message):
      engine.submit([1, 2], temperature=1.0, **bad)
  with pytest.raises(ValueError, match="acceptance='greedy' must be one of 'threshold', 'speculative'"):
    rj.ReFusion(acceptance="greedy")


def test_speculative_decodes_are_batch_invariant_and_greedy_is_plan_then_ar_argmax(model):
  serial_blocks = 2
  prompts = _prompts(6, 4)
  method = rj.ReFusion(
    gen_length=8, slot_size=2, serial_blocks=serial_blocks, temperature=0.8, acceptance="speculative"
  )
  fields = dict(mask_id=MASK, eos_id=EOS, logprobs=True)
  by_two = rj.decode(model, prompts, method, rows=2, **fields)
  by_four = rj.decode(model, prompts, method, rows=4, **fields)
  assert by_two.tokens == by_four.tokens
  np.testing.assert_allclose(by_two.rollout.logprobs, by_four.rollout.logprobs, atol=1e-5)
  # Greedy: a first-cycle slot's second token is the AR argmax given the prompt and the slot's first token.
  greedy_method = rj.ReFusion(gen_length=8, slot_size=2, serial_blocks=serial_blocks, acceptance="speculative")
  greedy = rj.decode(model, prompts, greedy_method, **fields)
  checked = 0
  for row, prompt in enumerate(prompts):
    tokens, iteration = greedy.rollout.tokens[row], greedy.rollout.iteration[row]
    for second in range(1, 8, 2):
      if iteration[second] != 0:
        continue
      ids = prompt + [int(tokens[second - 1])]
      positions = list(range(len(prompt))) + [len(prompt) + second - 1]
      length = len(ids)
      logits, _ = model(jnp.asarray([ids]), jnp.asarray([positions]), jnp.tril(jnp.ones((1, length, length), bool)))
      assert int(np.argmax(np.asarray(logits[0, -1]))) == tokens[second]
      expected = float(jax.nn.log_softmax(logits[0, -1].astype(jnp.float32))[tokens[second]])
      assert greedy.rollout.logprobs[row, second] == pytest.approx(expected, abs=1e-4)
      checked += 1
  assert checked >= 2
