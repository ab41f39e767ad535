"""The policies' probabilities are exact (docs/rl.md §3): on a model with V = 8 (the mask id included), G = 4 and
S = 2, every trajectory is listed by walking the decoding process with eager forwards (helpers/policy_tree.py);
their probabilities sum to 1, the replay gives each one's, and the jitted decoder's rollouts occur as often as
those probabilities say (a chi-square test that the official threshold rule fails)."""

from __future__ import annotations

import collections
import dataclasses
import functools

import numpy as np
import pytest
import scipy.stats
from flax import nnx
from helpers import policy_tree
from helpers.decode_cases import random_weights
from helpers.replay_reference import Layout

import refusion_jax as rj
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import init_model
from refusion_jax.rl import replay

VOCAB, MASK, EOS = 8, 7, 3
PROMPT = [1, 5, 2, 6]
SAMPLING = dict(temperature=0.8)


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  method: object
  slot_threshold: float = 0.5

  def leaves(self, model) -> list[policy_tree.Leaf]:
    m = self.method
    if m.name == "ar":
      return policy_tree.ar_leaves(model, PROMPT, gen_length=m.gen_length, eos_id=EOS, sampling=SAMPLING)
    return policy_tree.refusion_leaves(
      model,
      PROMPT,
      gen_length=m.gen_length,
      slot_size=m.slot_size,
      serial_blocks=m.serial_blocks,
      slot_threshold=self.slot_threshold,
      mask_id=MASK,
      eos_id=EOS,
      sampling=SAMPLING,
    )


CASES = [
  # slot_threshold 1: no slot is ever confident, one slot per cycle (two cycles, a tail each).
  Case("one-slot-per-cycle", Layout("refusion", 4, 2, 1), slot_threshold=1.0),
  # A tiny threshold: both slots in one cycle, drawn apart (neither sees the other).
  Case("slots-together", Layout("refusion", 4, 2, 1), slot_threshold=0.01),
  Case("two-blocks", Layout("refusion", 4, 2, 2)),
  Case("ar", Layout("ar", 4)),
]


@functools.cache
def _model():
  return random_weights(init_model(tiny(vocab_size=VOCAB)), seed=1, weight_std=0.3, head_std=1.0)


replay_jit = nnx.jit(
  replay.trajectory_logprobs, static_argnames=("method", "tail_length", "chunk", "mask_id", "eos_id")
)


def replayed(model, method, leaves: list[policy_tree.Leaf]) -> np.ndarray:
  """[leaves] float64 log π of each trajectory from one batched replay."""
  rollout = replay.Trajectory(np.stack([leaf.tokens for leaf in leaves]), np.stack([leaf.iteration for leaf in leaves]))
  rows = len(leaves)
  ids = np.tile(np.asarray(PROMPT, np.int32), (rows, 1))
  lengths = np.full(rows, len(PROMPT), np.int32)
  logprobs = replay_jit(model, ids, lengths, rollout, method, mask_id=MASK, eos_id=EOS, **SAMPLING)
  return np.nansum(np.asarray(logprobs, np.float64), axis=1)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_trajectory_listed_sums_to_one_and_the_replay_gives_each_ones_probability(case):
  leaves = _leaves(case)
  trajectories = {(tuple(leaf.tokens), tuple(leaf.iteration)) for leaf in leaves}
  assert len(trajectories) == len(leaves) > 2000  # distinct trajectories, the answers of ~7^4 grids
  reference = np.array([leaf.logprob for leaf in leaves])
  assert abs(np.exp(reference).sum() - 1) < 1e-5
  got = replayed(_model(), case.method, leaves)
  np.testing.assert_allclose(got, reference, atol=1e-4, rtol=0)
  assert abs(np.exp(got).sum() - 1) < 1e-5
  if case.name == "one-slot-per-cycle":
    assert max(int(leaf.iteration.max()) for leaf in leaves) == 1
  if case.name == "slots-together":
    assert {int(leaf.iteration.max()) for leaf in leaves} == {0}


DRAWS = 20_000


@functools.cache
def _leaves(case: Case) -> list[policy_tree.Leaf]:
  return case.leaves(_model())


def _key(tokens, iteration) -> tuple:
  """A trajectory as a hashable key: its tokens and its commit order (iterations renumbered 0, 1, ... so that a
  decoder counting loop iterations and the walk counting cycles name the same order)."""
  iteration = np.asarray(iteration)
  rank = {int(v): r for r, v in enumerate(np.unique(iteration[iteration >= 0]))}
  return tuple(int(t) for t in tokens), tuple(rank.get(int(i), -1) for i in iteration)


def _chi_square_p(leaves: list[policy_tree.Leaf], tokens: np.ndarray, iteration: np.ndarray) -> float:
  """The p-value of the rollouts' trajectory counts under the listed probabilities: Pearson's chi-square, the
  trajectories expected fewer than 5 times pooled into one cell; a trajectory not listed makes p = 0."""
  expected = {_key(leaf.tokens, leaf.iteration): len(tokens) * np.exp(leaf.logprob) for leaf in leaves}
  observed = collections.Counter(_key(t, i) for t, i in zip(tokens, iteration))
  if set(observed) - set(expected):
    return 0.0
  big = [key for key, count in expected.items() if count >= 5]
  cells_observed = [observed[key] for key in big] + [len(tokens) - sum(observed[key] for key in big)]
  cells_expected = [expected[key] for key in big] + [len(tokens) - sum(expected[key] for key in big)]
  statistic = sum((o - e) ** 2 / e for o, e in zip(cells_observed, cells_expected))
  return float(scipy.stats.chi2.sf(statistic, len(big)))


def _rollouts(case: Case, **changes) -> tuple[np.ndarray, np.ndarray]:
  m = case.method
  if m.name == "ar":
    method = rj.AR(gen_length=m.gen_length, **(SAMPLING | changes))
  else:
    fields = dict(slot_size=m.slot_size, serial_blocks=m.serial_blocks, slot_threshold=case.slot_threshold)
    method = rj.ReFusion(gen_length=m.gen_length, **(fields | dict(acceptance="speculative") | SAMPLING | changes))
  # DRAWS copies of one prompt: the sampling noise folds in each prompt's index, so they are independent draws.
  result = rj.decode(_model(), [PROMPT] * DRAWS, method, rows=500, mask_id=MASK, eos_id=EOS, logprobs=True)
  return np.asarray(result.rollout.tokens), np.asarray(result.rollout.iteration)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_jitted_decoders_rollouts_occur_as_often_as_their_probabilities_say(case):
  tokens, iteration = _rollouts(case)
  # The model and the draws are fixed (decode's seed 0), so the p-values are too: 0.10 to 0.28 for the four cases.
  assert _chi_square_p(_leaves(case), tokens, iteration) > 1e-3
  # The test has power: the official threshold rule, or AR at another temperature, is not this policy.
  wrong = dict(temperature=1.2) if case.method.name == "ar" else dict(acceptance="threshold")
  assert _chi_square_p(_leaves(case), *_rollouts(case, **wrong)) < 1e-6
