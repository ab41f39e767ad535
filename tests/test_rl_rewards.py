"""GRPO's pieces that need no model: group advantages, the KL estimators, the settings it refuses, the built-in
rewards and how a reward function that misbehaves is refused by name (refusion_jax.rl)."""

import numpy as np
import pytest

from refusion_jax.data import tasks
from refusion_jax.rl import rewards
from refusion_jax.rl.objective import GRPOConfig, aggregate, group_advantages, kl_estimate


def test_group_advantages_are_relative_to_each_prompts_answers():
  rewards_ = np.array([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0, 5.0])
  advantages = group_advantages(rewards_, 4)
  # Group 1: mean 0.5, sample std (Bessel) 0.577; group 2 all equal: advantage 0, not NaN.
  np.testing.assert_allclose(advantages[:4], [0.866025, -0.866025, -0.866025, 0.866025], rtol=1e-5)
  np.testing.assert_array_equal(advantages[4:], 0.0)
  np.testing.assert_allclose(group_advantages(rewards_, 4, "drgrpo")[:4], [0.5, -0.5, -0.5, 0.5])
  np.testing.assert_allclose(group_advantages(rewards_, 4, "rloo")[:4], [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)
  with pytest.raises(ValueError, match="prompts x num_generations=3"):
    group_advantages(rewards_, 3)


def test_kl_estimators_are_tunix_s():
  logp, ref = np.array([[-1.0, -2.0]]), np.array([[-1.5, -1.0]])
  r = ref - logp
  np.testing.assert_allclose(kl_estimate(logp, ref, "low_var_kl"), np.exp(r) - r - 1, rtol=1e-6)
  np.testing.assert_allclose(kl_estimate(logp, ref, "kl"), logp - ref)
  np.testing.assert_allclose(kl_estimate(logp, ref, "mse_kl"), 0.5 * r**2)


def test_aggregation_modes_count_only_masked_tokens():
  values = np.array([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
  mask = np.array([[1, 1, 0], [1, 0, 0]])
  assert float(aggregate(values, mask, "token-mean")) == pytest.approx(2.0)
  assert float(aggregate(values, mask, "sequence-mean-token-mean")) == pytest.approx((1.5 + 3.0) / 2)
  assert float(aggregate(values, mask, "sequence-mean-token-scale")) == pytest.approx((3 / 3 + 3 / 3) / 2)
  assert float(aggregate(values, mask, "seq-mean-token-sum")) == pytest.approx(3.0)


@pytest.mark.parametrize(
  "fields, named",
  [
    (dict(num_generations=1), "num_generations=1"),
    (dict(loss_agg_mode="mean"), "loss_agg_mode='mean'"),
    (dict(kl_loss_mode="k3"), "kl_loss_mode='k3'"),
    (dict(epsilon=-0.1), "epsilon=-0.1"),
  ],
)
def test_bad_settings_are_refused_by_name(fields, named):
  with pytest.raises(ValueError, match=named):
    GRPOConfig(**fields)


def test_built_in_rewards_grade_by_the_task_solvers():
  query = "sort: 7 2 9 2"
  right, near, wrong = tasks.solve("sort", query), "2 2 7 8", "banana"
  columns = dict(task=["sort"] * 3, response=[right] * 3)
  assert rewards.exact_match([query] * 3, [right, near, wrong], **columns) == [1.0, 0.0, 0.0]
  credit = rewards.partial_credit([query] * 3, [right, near, wrong], **columns)
  assert credit[0] == 1.0 > credit[1] > credit[2] >= 0.0
  # Records of no built-in task are graded against their response column.
  assert rewards.exact_match(["q"], [" a  b "], response=["a b"]) == [1.0]


def _raises(prompts, completions, **columns):
  raise KeyError("answer")


def _short(prompts, completions, **columns):
  return [1.0]


def _not_numbers(prompts, completions, **columns):
  return ["yes"] * len(completions)


@pytest.mark.parametrize(
  "reward, message",
  [
    (_raises, r"test_rl_rewards\._raises raised KeyError"),
    (_short, r"_short returned 1 rewards for 2 completions"),
    (_not_numbers, r"_not_numbers returned list"),
    (lambda p, c, **k: [0.0, float("nan")], "non-finite reward"),
  ],
)
def test_a_reward_that_raises_or_returns_the_wrong_length_is_refused_by_name(reward, message):
  with pytest.raises(rewards.RewardError, match=message):
    rewards.score([reward], ["a", "b"], ["x", "y"], {})


def test_rewards_are_named_by_import_path_and_summed():
  exact = rewards.load_reward("refusion_jax.rl.rewards.exact_match")
  assert exact is rewards.exact_match is rewards.load_reward("refusion_jax.rl.rewards:exact_match")
  total, parts = rewards.score([exact, rewards.partial_credit], ["q", "q"], ["a", "b"], {"response": ["a", "a"]})
  np.testing.assert_allclose(total, [2.0, 0.0])
  assert set(parts) == {"refusion_jax.rl.rewards.exact_match", "refusion_jax.rl.rewards.partial_credit"}
  for path, named in [
    ("nowhere.at_all", "cannot import 'nowhere'"),
    ("refusion_jax.rl.rewards.nothing", "no callable"),
  ]:
    with pytest.raises(ValueError, match=named):
      rewards.load_reward(path)
