"""Rewards: Python callables `(prompts, completions, **columns) -> list[float]`, named in a config by import path.

A reward function gets, for the N answers of a step, the N prompts (each query, as the data holds it), the N
completions (the decoded answers, EOS stripped) and every other column of the prompts' records as a keyword
argument holding N values (an answer's record is its prompt's: each appears `num_generations` times). It returns N
finite numbers. The trainer sums the rewards of every function the config names (tunix's and TRL's rule) and
refuses, naming the function, one that raises or returns the wrong number or kind of values (`RewardError`).

Built in, from the task solvers of `refusion_jax.data.tasks` (records with a `task` column are graded by solving
their query again, others against their `response` column):

- `exact_match`: 1 for an answer `tasks.is_correct` accepts, else 0 (what validation's exact match counts);
- `partial_credit`: the similarity of the graded answer to the reference, in [0, 1] (difflib's ratio of the two
  whitespace-normalised texts): a nearly right answer earns more than a wrong one, so a group whose answers are all
  wrong still has an advantage to follow.
"""

from __future__ import annotations

import difflib
import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from refusion_jax.data import tasks

# (prompts, completions, **columns) -> one reward per completion.
RewardFn = Callable[..., Sequence[float]]


class RewardError(ValueError):
  """A reward function raised, or returned what is not one finite number per completion (named in the message)."""


def _reference(task: str | None, query: str, response: str | None) -> tuple[str, Callable[[str], str]]:
  """The graded reference answer of a record and how an answer is graded (a built-in task's solver, else the
  record's response as it is)."""
  if task:
    try:
      return tasks.solve(task, query), tasks.graded_part(task)
    except ValueError:  # a task name the solvers do not know: the record's response is the reference
      pass
  if response is None:
    raise RewardError(
      "The built-in rewards grade an answer by its record's `task` (a built-in task) or its `response` column; "
      f"the record of {query!r} has neither."
    )
  return response, lambda text: text


def _column(columns: Mapping[str, Sequence[Any]], name: str, count: int) -> Sequence[Any]:
  return columns.get(name) or [None] * count


def exact_match(prompts: Sequence[str], completions: Sequence[str], **columns: Sequence[Any]) -> list[float]:
  """1.0 for each completion `tasks.is_correct` accepts (a built-in task solved again, else the `response`
  column up to runs of whitespace), else 0.0."""
  task, response = _column(columns, "task", len(prompts)), _column(columns, "response", len(prompts))
  return [
    float(tasks.is_correct({"query": q, "response": r or "", "task": t or ""}, c))
    for q, c, t, r in zip(prompts, completions, task, response)
  ]


def partial_credit(prompts: Sequence[str], completions: Sequence[str], **columns: Sequence[Any]) -> list[float]:
  """Per completion, difflib's similarity ratio in [0, 1] of its graded part to the reference's (both with runs
  of whitespace made one space): 1.0 exactly where `exact_match` gives 1."""
  task, response = _column(columns, "task", len(prompts)), _column(columns, "response", len(prompts))
  rewards = []
  for query, completion, name, reference in zip(prompts, completions, task, response):
    reference, graded = _reference(name, query, reference)
    answer, wanted = graded(" ".join(completion.split())), graded(" ".join(reference.split()))
    rewards.append(difflib.SequenceMatcher(None, answer, wanted, autojunk=False).ratio())
  return rewards


def load_reward(path: str) -> RewardFn:
  """The callable an import path names: "package.module.function" or "package.module:function".

  Raises:
    ValueError: the path names no importable callable (what is missing, and how to write the path).
  """
  if not isinstance(path, str) or not path.strip():
    raise ValueError(
      f"A reward is named by an import path such as 'refusion_jax.rl.rewards.exact_match', not {path!r}."
    )
  module_name, _, name = path.rpartition(":") if ":" in path else path.rpartition(".")
  if not module_name or not name:
    raise ValueError(f"Reward {path!r}: write it as 'package.module.function' or 'package.module:function'.")
  try:
    module = importlib.import_module(module_name)
  except ImportError as error:
    raise ValueError(f"Reward {path!r}: cannot import {module_name!r} ({error}).") from None
  reward = getattr(module, name, None)
  if not callable(reward):
    raise ValueError(f"Reward {path!r}: {module_name!r} has no callable {name!r}.")
  return reward


def reward_name(reward: RewardFn) -> str:
  """How messages and metrics name a reward function: its module and name."""
  return f"{getattr(reward, '__module__', '?')}.{getattr(reward, '__qualname__', repr(reward))}"


def score(
  rewards: Sequence[RewardFn],
  prompts: Sequence[str],
  completions: Sequence[str],
  columns: Mapping[str, Sequence[Any]],
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """The summed reward of each completion, and each function's own (by `reward_name`).

  Returns:
    ([N] float64 total, {name: [N] float64}).

  Raises:
    RewardError: a function raised, or did not return N finite numbers (named, with what it returned).
  """
  count = len(completions)
  parts = {}
  for reward in rewards:
    name = reward_name(reward)
    try:
      values = reward(list(prompts), list(completions), **{k: list(v) for k, v in columns.items()})
    except Exception as error:  # any failure of user code is reported as the reward's, by name
      raise RewardError(f"Reward function {name} raised {type(error).__name__}: {error}") from error
    try:
      values = [float(v) for v in values]
    except (TypeError, ValueError):
      raise RewardError(
        f"Reward function {name} returned {type(values).__name__} {str(values)[:200]}; it must return one number "
        f"per completion (a list of {count} floats)."
      ) from None
    if len(values) != count:
      raise RewardError(
        f"Reward function {name} returned {len(values)} rewards for {count} completions; it must return one per "
        "completion, in their order."
      )
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
      raise RewardError(
        f"Reward function {name} returned a non-finite reward ({values[bad[0]]}) for completion {bad[0]}."
      )
    parts[name] = np.asarray(values, np.float64)
  total = np.sum(list(parts.values()), axis=0) if parts else np.zeros(count)
  return total, parts
