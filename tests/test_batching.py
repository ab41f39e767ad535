"""Continuous batching and forwards fitted to their work, for every jitted decoder.

A row's decode must not depend on the other rows, on which row decodes it,
on how many rows there are, on the compiled width a forward ran at, or on
whether the loop ran in one call or in chunks: each prompt gets exactly its
own B = 1 decode (token for token here; across row counts XLA may round logits ~1e-6 apart, which the tests'
fixed draws do not meet at a near tie, docs/method.md §3.3). The tests share a few program shapes (K rows, prompts of
one bucket) so that they compile once each.
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from helpers.decode_cases import random_weights, same_decode
from helpers.hand_cases import HAND_CASES, bigram_model, hand_knobs
from hypothesis import given, settings
from hypothesis import strategies as st

import refusion_jax as rj
from refusion_jax.decoding import scheduler
from refusion_jax.decoding.compilations import compilations
from refusion_jax.decoding.loop import compile_count
from refusion_jax.decoding.result import STAGE_NAMES
from refusion_jax.decoding.sampler import Sampler
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import init_model

VOCAB = 24
MASK = VOCAB - 1
ROWS = 3  # K: fewer rows than prompts, so finished rows take new prompts


def random_setup(seed: int, count: int = 8, max_prompt: int = 16):
  """A tiny model with fresh random weights, `count` prompts of random lengths (one bucket) and an EOS id."""
  rng = np.random.default_rng(seed)
  model = random_weights(
    init_model(tiny(vocab_size=VOCAB)), seed, weight_std=0.3, head_std=float(rng.uniform(0.3, 1.2))
  )
  prompts = [rng.integers(0, VOCAB - 1, int(n)).tolist() for n in rng.integers(1, max_prompt + 1, count)]
  return model, prompts, int(rng.integers(0, VOCAB - 1)), rng


def refusion_method(rng, **changes) -> rj.ReFusion:
  """ReFusion at G = 16, S = 4, two serial blocks and random thresholds; `changes` set other fields."""
  fields = dict(
    gen_length=16,
    slot_size=4,
    serial_blocks=2,
    slot_threshold=float(rng.uniform(0.1, 0.9)),
    token_threshold=float(rng.uniform(0.1, 0.9)),
  )
  return rj.ReFusion(**{**fields, **changes})


def assert_each_row_is_its_own_decode(batched, singles):
  """Row i of `batched` decodes exactly as the batch-1 result singles[i]."""
  for row, single in enumerate(singles):
    assert not same_decode(batched, single, row_a=row), f"row {row}: {same_decode(batched, single, row_a=row)}"


def assert_same_rows(a, b):
  assert len(a.tokens) == len(b.tokens)
  for row in range(len(a.tokens)):
    assert not same_decode(a, b, row_a=row, row_b=row), f"row {row}: {same_decode(a, b, row_a=row, row_b=row)}"


@pytest.mark.parametrize("seed", [0, 1])
def test_refusion_continuous_batching_gives_each_prompt_its_single_decode(seed):
  model, prompts, eos, rng = random_setup(seed)
  method, ids = refusion_method(rng), dict(mask_id=MASK, eos_id=eos)
  singles = [rj.decode(model, [p], method, **ids) for p in prompts]
  continuous = rj.decode(model, prompts, method, **ids, rows=ROWS)
  assert_each_row_is_its_own_decode(continuous, singles)
  # Rows finish at different iterations, so a finished row really took a new prompt.
  assert len({int(s.num_forwards[0]) for s in singles}) > 1
  # One batched forward per loop iteration: fewer than the single decodes' forwards together.
  assert sum(continuous.widths["forward"].values()) < sum(sum(s.widths["forward"].values()) for s in singles)


def test_sampled_refusion_draws_noise_by_prompt_not_by_row():
  model, prompts, eos, rng = random_setup(2)
  method, options = refusion_method(rng, temperature=1.3), dict(mask_id=MASK, eos_id=eos, seed=11)
  static = rj.decode(model, prompts, method, **options)
  assert_same_rows(rj.decode(model, prompts, method, **options, rows=ROWS), static)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_ar_continuous_batching_matches_static_and_single_decodes(temperature):
  model, prompts, eos, _ = random_setup(3)
  method, options = rj.AR(gen_length=10, temperature=temperature), dict(eos_id=eos, seed=5)
  continuous = rj.decode(model, prompts, method, **options, rows=ROWS)
  if temperature == 0:
    assert_each_row_is_its_own_decode(continuous, [rj.decode(model, [p], method, **options) for p in prompts])
  else:
    assert_same_rows(continuous, rj.decode(model, prompts, method, **options))
  assert len(set(continuous.num_forwards.tolist())) > 1  # rows stopped at their own EOS


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_mdm_continuous_batching_matches_static_and_single_decodes(temperature):
  model, prompts, eos, _ = random_setup(4)
  method = rj.MDM(gen_length=8, block_length=4, steps=4, temperature=temperature)
  options = dict(mask_id=MASK, eos_id=eos, seed=2)
  continuous = rj.decode(model, prompts, method, **options, rows=ROWS)
  if temperature == 0:
    assert_each_row_is_its_own_decode(continuous, [rj.decode(model, [p], method, **options) for p in prompts])
  else:
    assert_same_rows(continuous, rj.decode(model, prompts, method, **options))


def chunkable(method, model, eos, rng):
  """The method's value and special ids of the tests above, as (prompts, **decode options) -> DecodeResult."""
  if method == "refusion":
    value, ids = refusion_method(rng), dict(mask_id=MASK, eos_id=eos)
  elif method == "ar":
    value, ids = rj.AR(gen_length=10), dict(eos_id=eos)
  else:
    value, ids = rj.MDM(gen_length=8, block_length=4, steps=4), dict(mask_id=MASK, eos_id=eos)
  return lambda prompts, **options: rj.decode(model, prompts, value, **ids, **options)


@pytest.mark.parametrize("method", ["refusion", "ar", "mdm"])
def test_the_loop_runs_in_chunks_state_in_state_out_without_recompiling(method):
  model, prompts, eos, rng = random_setup(5)
  decode = chunkable(method, model, eos, rng)
  whole = decode(prompts, rows=ROWS)
  before = compile_count(method)
  for chunk in (1, 3, 7):
    assert_same_rows(decode(prompts, rows=ROWS, chunk_iterations=chunk), whole)
  # Another prompt count in the same prompt bucket (16) reuses the program too.
  assert_same_rows(decode(prompts[:5], rows=ROWS, chunk_iterations=2), decode(prompts[:5], rows=ROWS))
  assert compile_count(method) == before


def test_compilations_counts_what_jax_builds_not_what_it_traces():
  """A program compiled again for an argument's placement alone (no new trace) is counted too."""
  double = jax.jit(lambda x: 2 * x)
  host = np.arange(5.0, dtype=np.float32)
  before = compilations()
  double(host)
  assert compilations() == before + 1
  double(host + 1)
  assert compilations() == before + 1
  double(jax.device_put(host, jax.devices()[0]))  # committed where the first call's argument was not
  assert compilations() == before + 2


def test_one_compile_for_any_prompt_count_at_one_batch_size():
  """The queue is fed from the host: 16, 64, 100 or 5 prompts of one bucket at K = 8 share one program, also on
  the first call that refills the queue (the loop's inputs arrive placed alike on every call)."""
  model, prompts, eos, rng = random_setup(10, count=100)
  # Weights committed to a device, as loaded checkpoints are: loop outputs come back committed too.
  graphdef, params = nnx.split(model)
  model = nnx.merge(graphdef, jax.device_put(params, jax.devices()[0]))
  # A slot layout no other test compiles at 8 rows, so the count below starts from zero.
  method, ids = refusion_method(rng, gen_length=20, slot_size=5), dict(mask_id=MASK, eos_id=eos)
  singles = [rj.decode(model, [p], method, **ids) for p in prompts]
  before = compile_count("refusion")
  assert_each_row_is_its_own_decode(rj.decode(model, prompts[:16], method, **ids, rows=8), singles[:16])
  assert compile_count("refusion") == before + 1
  every_compile = compilations()
  for count in (64, 100, 5):
    assert_each_row_is_its_own_decode(rj.decode(model, prompts[:count], method, **ids, rows=8), singles[:count])
  assert compilations() == every_compile


HAND_WIDTHS = {
  # Two undecided slots are planned at width 8; one chosen slot is verified at width 4; the last one alone at 4.
  "one slot per plan": dict(forward={8: 1, 4: 3}, plan={8: 1, 4: 1}, verify={4: 2}),
  # Both slots chosen: width 8 throughout, the infill too.
  "token by token infill": dict(forward={8: 8}, plan={8: 1}, verify={8: 1}, draft={8: 3}, check={8: 3}),
  # Blocks of one slot each: every forward is one slot wide.
  "one plan per serial block": dict(forward={4: 4}, plan={4: 2}, verify={4: 2}),
}


@pytest.mark.parametrize("name", HAND_WIDTHS)
def test_forwards_run_only_as_wide_as_the_active_slots(name):
  case = HAND_CASES[name]
  model = bigram_model(*case["model"])
  method = rj.ReFusion(**hand_knobs(case))
  fitted = rj.decode(model, [[2, 3, 4]], method)
  full = rj.decode(model, [[2, 3, 4]], dataclasses.replace(method, fit_width=False))
  assert fitted.tokens == full.tokens == [case["tokens"]]
  assert {name: counts for name, counts in fitted.widths.items() if counts} == HAND_WIDTHS[name]
  block = 8 // case["serial_blocks"]
  assert full.widths["forward"] == {block: int(full.num_forwards[0]) - 1}  # the prefill is not a loop forward


def test_rows_wait_for_a_forward_of_their_width_and_stay_exact():
  model, prompts, eos, rng = random_setup(6, count=4)
  # Blocks of 4 slots (widths 4, 8, 16); a high slot threshold makes plans choose few slots.
  method = refusion_method(rng, serial_blocks=1, slot_threshold=0.95, token_threshold=0.3)
  ids = dict(mask_id=MASK, eos_id=eos)
  fitted = rj.decode(model, prompts, method, **ids)
  full = rj.decode(model, prompts, dataclasses.replace(method, fit_width=False), **ids)
  assert_same_rows(fitted, full)
  assert set(fitted.widths["forward"]) <= {4, 8, 16} and min(fitted.widths["forward"]) < 16
  # Full width: every iteration is one forward of every unfinished row.
  assert sum(full.widths["forward"].values()) == int(np.max(full.num_forwards)) - 1
  # Fitted: a forward takes only the rows whose work fits its shape, the others wait; every row forward
  # sits in one stage, and forwards of 4 tokens take all 4 rows at once (a budget of 32 tokens).
  stage_forwards = sum(sum(fitted.widths[s].values()) for s in STAGE_NAMES)
  assert stage_forwards == int(np.sum(fitted.num_forwards)) - len(prompts)
  assert sum(fitted.widths["forward"].values()) >= int(np.max(fitted.num_forwards)) - 1
  narrow = sum(fitted.widths[s].get(4, 0) for s in STAGE_NAMES)
  assert narrow > fitted.widths["forward"][4]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-1, 5), min_size=1, max_size=8), st.data())
def test_row_picks_are_a_stable_descending_sort(priority, data):
  """The scheduler's sort-free pick is what argsort would pick, ties included (small values force ties)."""
  count = data.draw(st.integers(1, len(priority)))
  priority = np.asarray(priority, np.int32)
  want = np.argsort(-priority, kind="stable")[:count]
  np.testing.assert_array_equal(jax.jit(scheduler._leading, static_argnums=1)(priority, count), want)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=8, max_size=8), min_size=1, max_size=4))
def test_compact_order_is_the_stable_partition_and_its_inverse(active):
  active = np.asarray(active)
  order, back = jax.jit(scheduler._compact_order)(active)
  np.testing.assert_array_equal(order, np.argsort(~active, axis=-1, kind="stable"))
  np.testing.assert_array_equal(
    np.take_along_axis(np.asarray(back), np.asarray(order), -1), np.broadcast_to(np.arange(8), active.shape)
  )


def test_sampler_passes_batch_size_through():
  model, prompts, eos, rng = random_setup(8)
  method, ids = refusion_method(rng), dict(mask_id=MASK, eos_id=eos)

  class Ids:  # a tokenizer whose texts are comma-separated ids
    mask_id = eos_id = pad_id = bos_id = None

    def encode(self, text):
      return [int(t) for t in text.split(",")]

    def decode(self, ids):
      return ",".join(map(str, ids))

  texts = [",".join(map(str, p)) for p in prompts]
  answers = Sampler(model, Ids(), method, **ids, rows=ROWS)(texts)
  singles = [rj.decode(model, [p], method, **ids).tokens[0] for p in prompts]
  assert answers == [Ids().decode(t) for t in singles]


@pytest.mark.parametrize("name", ["rows", "chunk_iterations"])
@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_bad_rows_or_chunk_is_rejected(name, value):
  model, prompts, eos, rng = random_setup(9, count=2)
  with pytest.raises(ValueError, match=f"{name}=.* must be a positive integer"):
    rj.decode(model, prompts, refusion_method(rng), mask_id=MASK, eos_id=eos, **{name: value})
