"""A run's data: the splits it trains and validates on, built once, and their batch iterators.

`open_splits` builds the configured data set with tensorflow-datasets into
array_record under the workdir (process 0 builds, the others wait) and opens
every split as a random-access source; `batches` turns a split into this
process's grain dataset of token batches (`refusion_jax.data.pipeline`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import grain
import jax
import ml_collections
from jax.experimental import multihost_utils

from refusion_jax.data import pipeline
from refusion_jax.data.tokenizer import Tokenizer


def open_splits(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Sequence[Any]]:
  """{split: random-access records}, building the tfds dataset on first use (process 0 builds, the others wait)."""
  if jax.process_index() == 0:
    splits = _build(config, workdir)
  multihost_utils.sync_global_devices("refusion_jax: data built")
  return splits if jax.process_index() == 0 else _build(config, workdir)


def _build(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Sequence[Any]]:
  from refusion_jax.data import builders  # imports tensorflow-datasets

  data = config.data
  data_dir = data.data_dir or os.path.join(workdir, "data")
  if data.dataset == "tasks":
    return builders.build_refusion_tasks(
      data_dir,
      num_train=data.num_train,
      num_validation=data.num_validation,
      num_test=data.num_test,
      seed=data.seed,
      task_names=tuple(data.tasks),
    )
  if data.dataset == "json":
    files = {split: [f for f in data.get(f"{split}_files", "").split(",") if f] for split in ("train", "validation")}
    return builders.build_query_response_json(data_dir, {k: v for k, v in files.items() if v})
  raise ValueError(f"config.data.dataset={data.dataset!r}; choose 'tasks' or 'json'.")


def data_name(config: ml_collections.ConfigDict, split: str) -> str:
  """What a split is, for messages: its files, or the built-in tasks."""
  if config.data.dataset == "json":
    return f"the {split} data (config.data.{split}_files={config.data.get(f'{split}_files')})"
  return f"the {split} split of the built-in tasks {tuple(config.data.tasks)}"


def batches(
  source: Sequence[Any], tokenizer: Tokenizer, config: ml_collections.ConfigDict, *, train: bool
) -> grain.IterDataset:
  """The grain dataset of this process's rows: endless and shuffled for training, one ordered pass for eval.

  Both pack examples into rows when `config.data.packing` (the loss is normalised per token and per example, so
  validation batches measure the same loss either way); the MDM baseline cannot pack (docs/method.md §1).
  """
  if config.data.packing and config.objective.kind == "mdm":
    raise ValueError(
      "The mdm objective runs every answer to the end of its row, so its rows cannot be packed "
      "(docs/method.md §1): set --config.data.packing=False."
    )
  return pipeline.make_dataset(
    source,
    tokenizer,
    seq_len=config.data.seq_len,
    batch_size=config.batch_size // jax.process_count(),
    seed=config.seed,
    shuffle=train,
    num_epochs=None if train else 1,
    chat_template=config.data.chat_template,
    name=data_name(config, "train" if train else "validation"),
    warn_drop_fraction=config.data.warn_drop_fraction,
    packing=config.data.packing,
    max_segments=config.data.max_segments,
  )
