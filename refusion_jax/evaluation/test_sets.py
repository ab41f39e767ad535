"""A test set to evaluate on: a built-in task split as training builds it, or a JSON file of records."""

from __future__ import annotations

import os

import ml_collections

from refusion_jax.data.tasks import generate_examples


def load_examples(
  config: ml_collections.ConfigDict, *, split: str, data: str | None = None, num_examples: int | None = None
) -> tuple[list[dict], dict]:
  """The test examples ({query, response[, task]}) and a description of where they came from.

  Args:
    config: the training config whose data section builds the split (its tasks, seed, split size).
    split: "train", "validation" or "test".
    data: a JSON file of {"query", "response"[, "task"]} records instead of the split.
    num_examples: only the first N examples.

  Raises:
    ValueError: the file does not exist, the config does not build a split, or N < 1.
  """
  if data:
    if not os.path.isfile(data):
      raise ValueError(f"--data {data!r} is not a file; pass a JSON list of query/response records.")
    from refusion_jax.data.builders import read_query_response_json  # imports tensorflow-datasets: JSON only

    examples, source = read_query_response_json(data), dict(file=os.path.abspath(data))
  else:
    section = config.data
    if section.dataset != "tasks":
      raise ValueError(f"The config trains on data.dataset={section.dataset!r}; pass its test file as --data.")
    size = section.get(f"num_{split}")
    examples = generate_examples(split, size, seed=section.seed, tasks=tuple(section.tasks))
    source = dict(split=split, tasks=sorted(set(section.tasks)), seed=section.seed, split_size=size)
  if num_examples is not None:
    if num_examples < 1:
      raise ValueError(f"--num_examples={num_examples} must be at least 1.")
    examples = examples[:num_examples]
  return examples, source
