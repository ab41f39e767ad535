"""Fuzzed invariants of ReFusion decoding (docs/method.md §2, §3), through the public decode API only.

Hypothesis draws tiny models (fresh random weights, LM heads from flat to
peaked), three prompts of random lengths and random settings (thresholds, EOS
id, temperature, seed). The three prompts are decoded together (B = 3) and
one by one (B = 1) with `rj.decode`, and one by
one with the eager `refusion_jax.decoding.reference.decode_reference`. Every
decode must:

- emit tokens inside the vocabulary;
- end each answer at its first EOS: no EOS before the last token, and an
  answer shorter than G ends with one;
- commit exactly the answer's positions, all inside the generation window
  [0, G), each by a plan step the row ran and by verification or infill;
- take at least the forwards the settings allow: the prefill, then a plan and
  a verification per serial block the answer reaches (two per plan step);
- give each batched row the decode of its prompt alone (greedy decoding; a
  sampled decode keys its noise by row, so only row 0 is comparable);
- equal the eager reference, tokens and trace, unless a decision sits within
  float rounding of a threshold (such cases are discarded, see `on_a_tie`).

Weights, prompts and knobs are jit arguments, so the CI run compiles only the
B = 1 and B = 3 programs of one model shape and slot layout; the slow run also
draws the architecture and the layout.
"""

import jax
import numpy as np
import pytest
from flax import nnx
from helpers.decode_cases import decode_as_reference
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from refusion_jax.decoding.reference import decode_reference
from refusion_jax.decoding.result import PHASE_INFILL, PHASE_NONE, PHASE_VERIFY
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import Transformer, init_model

VOCAB = 16
MASK_ID = VOCAB - 1
BATCH = 3
MAX_PROMPT = 16  # one prompt bucket: no compilation per prompt length
# (gen_length, slot_size, serial_blocks): the CI layout first.
LAYOUTS = [(8, 2, 2), (12, 4, 1), (12, 2, 3), (8, 1, 2)]
ARCHITECTURES = ["qwen3", "qwen2", "llama"]
# Decisions closer than this to a threshold are ties that float rounding may break either way.
TIE = 1e-4


def random_model(architecture: str, seed: int, weight_scale: float, head_scale: float) -> Transformer:
  """A tiny model with `init_model`'s random weights scaled up; norm scales untouched.

  `head_scale` sets how peaked the token distributions are, so that
  probabilities fall on both sides of the thresholds.
  """
  graphdef, params = nnx.split(init_model(tiny(vocab_size=VOCAB, architecture=architecture), seed))

  def scale(path, x):
    name = jax.tree_util.keystr(path)
    if "norm" in name:
      return x
    return x * (head_scale if "lm_head" in name else weight_scale)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(scale, params))


def cases(architectures: list[str], layouts: list[tuple[int, int, int]]) -> st.SearchStrategy:
  """(model, prompts, decode knobs) for `decode_as_reference` and `decode_reference` alike."""
  thresholds = st.one_of(st.floats(0.02, 0.98), st.sampled_from([0.5, 0.9, 1.0]))
  return st.builds(
    lambda architecture, seed, weight_scale, head_scale, layout, prompts, knobs: (
      random_model(architecture, seed, weight_scale, head_scale),
      prompts,
      dict(zip(("gen_length", "slot_size", "serial_blocks"), layout), mask_id=MASK_ID, **knobs),
    ),
    architecture=st.sampled_from(architectures),
    seed=st.integers(0, 2**30),
    weight_scale=st.floats(2.5, 20.0),
    head_scale=st.floats(5.0, 75.0),
    layout=st.sampled_from(layouts),
    prompts=st.lists(
      st.lists(st.integers(0, MASK_ID - 1), min_size=1, max_size=MAX_PROMPT), min_size=BATCH, max_size=BATCH
    ),
    knobs=st.fixed_dictionaries(
      dict(
        slot_threshold=thresholds,
        token_threshold=thresholds,
        eos_id=st.integers(0, MASK_ID - 1),
        temperature=st.one_of(st.just(0.0), st.floats(0.3, 2.0)),
        seed=st.integers(0, 2**16),
      )
    ),
  )


def check_row(result, row: int, knobs: dict) -> None:
  """The invariants one decoded row must satisfy on its own."""
  gen_length, eos_id = knobs["gen_length"], knobs["eos_id"]
  block_length = gen_length // knobs["serial_blocks"]
  tokens = result.tokens[row]
  assert 1 <= len(tokens) <= gen_length
  assert all(0 <= t < VOCAB for t in tokens), tokens
  assert eos_id not in tokens[:-1], f"EOS before the end: {tokens}"
  assert len(tokens) == gen_length or tokens[-1] == eos_id, f"short answer without EOS: {tokens}"
  iteration, phase = np.asarray(result.commit_iteration[row]), np.asarray(result.commit_phase[row])
  assert iteration.shape == phase.shape == (gen_length,)
  steps = int(result.steps[row])
  inside = np.arange(gen_length) < len(tokens)
  assert ((iteration >= 0) & (iteration < steps))[inside].all(), iteration
  assert np.isin(phase[inside], (PHASE_VERIFY, PHASE_INFILL)).all(), phase
  assert (iteration[~inside] == -1).all() and (phase[~inside] == PHASE_NONE).all()
  blocks_reached = (len(tokens) - 1) // block_length + 1
  assert steps >= blocks_reached
  assert int(result.num_forwards[row]) >= 1 + 2 * steps  # the prefill, then a plan and a verification per step


def same_row(a, b, row_a: int, row_b: int = 0) -> bool:
  return a.tokens[row_a] == b.tokens[row_b] and all(
    np.array_equal(getattr(a, field)[row_a], getattr(b, field)[row_b])
    for field in ("num_forwards", "steps", "commit_iteration", "commit_phase")
  )


def on_a_tie(model: Transformer, prompt: list[int], knobs: dict) -> bool:
  """Whether a decision of this decode sits within float rounding of a threshold.

  Then the jitted decoder and the eager reference, which round differently, may
  legitimately decide differently: nudging both thresholds by ±`TIE` changes
  the reference's own decode.
  """
  nudged = [
    decode_reference(
      model,
      prompt,
      **dict(knobs, **{name: min(1.0, knobs[name] + sign * TIE) for name in ("slot_threshold", "token_threshold")}),
    )
    for sign in (-1, 1)
  ]
  return not same_row(nudged[0], nudged[1], 0)


def check_case(model: Transformer, prompts: list[list[int]], knobs: dict) -> None:
  assume(not any(on_a_tie(model, prompt, knobs) for prompt in prompts))
  batched = decode_as_reference(model, prompts, knobs)
  for row, prompt in enumerate(prompts):
    check_row(batched, row, knobs)
    alone = decode_as_reference(model, [prompt], knobs)
    check_row(alone, 0, knobs)
    if knobs["temperature"] == 0.0 or row == 0:
      assert same_row(batched, alone, row), f"row {row}: batched {batched.tokens[row]} alone {alone.tokens[0]}"
    reference = decode_reference(model, prompt, **knobs)
    assert same_row(alone, reference, 0), f"row {row}: jitted {alone.tokens[0]} reference {reference.tokens[0]}"


@settings(
  max_examples=50,
  deadline=None,
  derandomize=True,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
@given(cases(ARCHITECTURES[:1], LAYOUTS[:1]))
def test_decode_invariants(case):
  check_case(*case)


@pytest.mark.slow
@settings(
  max_examples=500,
  deadline=None,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
@given(cases(ARCHITECTURES, LAYOUTS))
def test_decode_invariants_across_architectures_and_layouts(case):
  check_case(*case)
