"""The policies' probabilities are exact (docs/rl.md §3): on a model with V = 8 (the mask id included), G = 4 and
S = 2, every trajectory is listed by walking the decoding process with eager forwards (helpers/policy_tree.py);
their probabilities sum to 1, the replay gives each one's, and the jitted decoder's rollouts occur as often as
those probabilities say (a chi-square test that the official threshold rule fails)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flax import nnx
from helpers import policy_tree
from helpers.decode_cases import random_weights
from helpers.replay_reference import Layout

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


@pytest.fixture(scope="module")
def model():
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
def test_every_trajectory_listed_sums_to_one_and_the_replay_gives_each_ones_probability(model, case):
  leaves = case.leaves(model)
  trajectories = {(tuple(leaf.tokens), tuple(leaf.iteration)) for leaf in leaves}
  assert len(trajectories) == len(leaves) > 2000  # distinct trajectories, the answers of ~7^4 grids
  reference = np.array([leaf.logprob for leaf in leaves])
  assert abs(np.exp(reference).sum() - 1) < 1e-5
  got = replayed(model, case.method, leaves)
  np.testing.assert_allclose(got, reference, atol=1e-4, rtol=0)
  assert abs(np.exp(got).sum() - 1) < 1e-5
  if case.name == "one-slot-per-cycle":
    assert max(int(leaf.iteration.max()) for leaf in leaves) == 1
  if case.name == "slots-together":
    assert {int(leaf.iteration.max()) for leaf in leaves} == {0}
