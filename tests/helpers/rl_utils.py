"""Helpers for the GRPO trainer's tests: its smoke config, a step that records what each step did, a reward."""

import os
import time
from typing import Any

import jax
import ml_collections

from helpers.train_utils import load_config
from refusion_jax.decoding.compilations import compilations
from refusion_jax.rl.trainer import GRPOSteps
from refusion_jax.training.loop import StepParts


def grpo_config(data_dir: str, kind: str = "ar", **overrides: Any) -> ml_collections.ConfigDict:
  """configs/grpo_demo.py:smoke on `data_dir` for the `kind` policy: 2 prompts x 2 answers a step, two updates
  per rollout (so that the second one's ratio leaves 1 and the clip and the KL act), 4 steps."""
  config = load_config("grpo_demo")
  config.data.data_dir = data_dir
  config.objective.kind = kind
  config.grpo.update(num_iterations=2, beta=0.04, epsilon_high=0.28)
  config.grpo.rewards = (*config.grpo.rewards, "helpers.rl_utils.stalls_in_step_3_when_asked")
  config.optimizer.lr = 1e-2
  config.update({"num_train_steps": 4, **overrides})
  return config


class RecordingSteps(GRPOSteps):
  """GRPO's steps, recording each step's metrics (host floats) and the process's compilations after it."""

  def __init__(self, config: ml_collections.ConfigDict):
    super().__init__(config)
    self.metrics: list[dict[str, float]] = []
    self.compilations: list[int] = []

  def build(self, parts: StepParts) -> Any:
    step = super().build(parts)

    def recorded(state: Any, batch: Any) -> Any:
      state, metrics = step(state, batch)
      self.metrics.append({k: float(v) for k, v in jax.device_get(metrics).items()})
      self.compilations.append(compilations())
      return state, metrics

    return recorded


def answer_length_reward(prompts: list[str], completions: list[str], *, answer: list[str], **_: Any) -> list[float]:
  """A reward reading a JSON column: how close each completion's length is to its record's `answer`'s."""
  return [-abs(len(c) - len(a)) / 10 for c, a in zip(completions, answer)]


def raising_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
  raise RuntimeError("the grader is down")


_CALLS = [0]


def stalls_in_step_3_when_asked(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
  """Zero rewards; in a process started with RL_TEST_STALL=1, its third call (step 3) hangs, so that a test can kill
  the run once steps 1 and 2 are checkpointed."""
  _CALLS[0] += 1
  if _CALLS[0] == 3 and os.environ.get("RL_TEST_STALL"):
    time.sleep(600)
  return [0.0] * len(completions)
