"""Query/response JSON of a few dozen to a few hundred tokens, built from the built-in tasks.

The built-in tasks fit 64 byte tokens; real query/response data (the release's
`train_data.json`) is longer and varies more, which is what packing rows
(docs/method.md §1) is for. A composite record joins 1 to `max_parts`
built-in examples of one split: their queries with " | ", their responses
likewise, so its response is still a function of its query (graded by exact
match). With the demo's tasks and `max_parts=6`, records run from about 20 to
about 310 byte tokens, about 160 on average.

    python -m refusion_jax.data.composite --out_dir /tmp/composite
    python -m refusion_jax.train --config configs/demo.py --workdir /tmp/packed --config.data.dataset=json \\
      --config.data.train_files=/tmp/composite/train.json \\
      --config.data.validation_files=/tmp/composite/validation.json --config.data.seq_len=512

Deterministic in its arguments: the same flags write the same files.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence

from absl import app, flags

from refusion_jax.data import tasks

SEPARATOR = " | "


def composite_examples(
  split: str, num_examples: int, *, seed: int = 0, task_names: Sequence[str] = tasks.TASKS, max_parts: int = 6
) -> list[dict[str, str]]:
  """`num_examples` records, each 1..`max_parts` (uniform) distinct built-in examples of `split`.

  The parts come from a pool of `num_examples` built-in examples of the split
  (a task has too few distinct queries for every part to be new), so the
  splits stay disjoint part by part.

  Returns:
    [{"query", "response"}], the parts joined with `SEPARATOR`.
  """
  if max_parts < 1:
    raise ValueError(f"max_parts={max_parts}; a record needs at least one part.")
  pool = tasks.generate_examples(split, max(num_examples, max_parts), seed=seed, tasks=task_names)
  rng = random.Random(f"refusion-composite:{seed}:{split}")
  records = []
  for _ in range(num_examples):
    parts = rng.sample(pool, rng.randint(1, max_parts))
    records.append(
      {
        "query": SEPARATOR.join(part["query"] for part in parts),
        "response": SEPARATOR.join(part["response"] for part in parts),
      }
    )
  return records


def write_json(
  out_dir: str,
  *,
  num_train: int,
  num_validation: int,
  seed: int = 0,
  task_names: Sequence[str] = tasks.TASKS,
  max_parts: int = 6,
) -> dict[str, str]:
  """Writes `train.json` and `validation.json` (JSON lists, as the release's) under `out_dir`; returns their paths."""
  os.makedirs(out_dir, exist_ok=True)
  paths = {}
  for split, size in (("train", num_train), ("validation", num_validation)):
    paths[split] = os.path.join(out_dir, f"{split}.json")
    records = composite_examples(split, size, seed=seed, task_names=task_names, max_parts=max_parts)
    with open(paths[split], "w", encoding="utf-8") as f:
      json.dump(records, f, indent=1)
  return paths


def main(argv: Sequence[str]) -> None:
  del argv
  f = flags.FLAGS
  paths = write_json(
    f.out_dir,
    num_train=f.num_train,
    num_validation=f.num_validation,
    seed=f.seed,
    task_names=tuple(f.tasks),
    max_parts=f.max_parts,
  )
  print("\n".join(f"{split}: {path}" for split, path in paths.items()))


if __name__ == "__main__":
  flags.DEFINE_string("out_dir", None, "Directory for train.json and validation.json.", required=True)
  flags.DEFINE_integer("num_train", 20_000, "Training records.")
  flags.DEFINE_integer("num_validation", 500, "Validation records.")
  flags.DEFINE_integer("seed", 0, "Generation seed.")
  flags.DEFINE_list("tasks", ["sort", "lookup", "code"], "Built-in tasks the parts come from (the demo's).")
  flags.DEFINE_integer("max_parts", 6, "Most built-in examples joined into one record.")
  app.run(main)
