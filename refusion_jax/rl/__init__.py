"""Reinforcement learning after supervised training: GRPO for ReFusion and AR (docs/rl.md).

- `replay.py`: each committed token's exact log-probability from one teacher-forced forward (`trajectory_logprobs`);
- `objective.py`: `GRPOConfig` (tunix's names), group advantages, KL estimators, `grpo_loss`;
- `logprobs.py`: a rollout batch's log-probabilities under the current weights (`RolloutBatch`);
- `rewards.py`: reward functions by import path, the built-in ones from the task solvers;
- `prompts.py`: prompt records with their columns, checked, and their batches;
- `trainer.py`: GRPO's step in the training loop (`GRPOSteps`, `train_grpo`).
"""

from refusion_jax.rl.objective import GRPOConfig, group_advantages, grpo_loss
from refusion_jax.rl.replay import trajectory_logprobs
from refusion_jax.rl.rewards import RewardError, exact_match, partial_credit
from refusion_jax.rl.trainer import GRPOSteps, train_grpo

__all__ = [
  "GRPOConfig",
  "GRPOSteps",
  "RewardError",
  "exact_match",
  "group_advantages",
  "grpo_loss",
  "partial_credit",
  "train_grpo",
  "trajectory_logprobs",
]
