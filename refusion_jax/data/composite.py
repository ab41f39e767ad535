"""Query/response JSON of a few dozen to a few hundred tokens, built from the built-in tasks.

The built-in tasks fit 64 byte tokens; real query/response data (the release's
`train_data.json`) is longer and varies more, which is what packing rows
(docs/method.md §1) is for. A composite record shows 0 to `max_context`
(uniform) solved built-in examples of its split as context, `query -> response`
joined by " | ", then one more query; its response is that query's response,
graded by exact match. So records are long, mostly prompt, and as learnable as
the built-in tasks. With the demo's tasks and `max_context=7`, records run
from 21 to about 500 byte tokens, about 210 on average.

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
ANSWERED = " -> "


def composite_examples(
  split: str, num_examples: int, *, seed: int = 0, task_names: Sequence[str] = tasks.TASKS, max_context: int = 7
) -> list[dict[str, str]]:
  """`num_examples` records of 0..`max_context` (uniform) solved examples and one query, all of `split`.

  The examples come from a pool of `num_examples` built-in examples of the
  split (a task has too few distinct queries for every one to be new), so the
  splits stay disjoint example by example; a record's examples are distinct.

  Returns:
    [{"query", "response"}]: the solved examples and the last query joined
    with `SEPARATOR`, each solved one as query `ANSWERED` response; the last
    query's response.
  """
  if max_context < 0:
    raise ValueError(f"max_context={max_context}; give the most solved examples shown (>= 0).")
  pool = tasks.generate_examples(split, max(num_examples, max_context + 1), seed=seed, tasks=task_names)
  rng = random.Random(f"refusion-composite:{seed}:{split}")
  records = []
  for _ in range(num_examples):
    *context, last = rng.sample(pool, rng.randint(0, max_context) + 1)
    shown = [f"{example['query']}{ANSWERED}{example['response']}" for example in context]
    records.append({"query": SEPARATOR.join([*shown, last["query"]]), "response": last["response"]})
  return records


def write_json(
  out_dir: str,
  *,
  num_train: int,
  num_validation: int,
  seed: int = 0,
  task_names: Sequence[str] = tasks.TASKS,
  max_context: int = 7,
) -> dict[str, str]:
  """Writes `train.json` and `validation.json` (JSON lists, as the release's) under `out_dir`; returns their paths."""
  os.makedirs(out_dir, exist_ok=True)
  paths = {}
  for split, size in (("train", num_train), ("validation", num_validation)):
    paths[split] = os.path.join(out_dir, f"{split}.json")
    records = composite_examples(split, size, seed=seed, task_names=task_names, max_context=max_context)
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
    max_context=f.max_context,
  )
  print("\n".join(f"{split}: {path}" for split, path in paths.items()))


if __name__ == "__main__":
  flags.DEFINE_string("out_dir", None, "Directory for train.json and validation.json.", required=True)
  flags.DEFINE_integer("num_train", 20_000, "Training records.")
  flags.DEFINE_integer("num_validation", 500, "Validation records.")
  flags.DEFINE_integer("seed", 0, "Generation seed.")
  flags.DEFINE_list("tasks", ["sort", "lookup", "code"], "Built-in tasks the parts come from (the demo's).")
  flags.DEFINE_integer("max_context", 7, "Most solved examples shown before a record's query.")
  app.run(main)
