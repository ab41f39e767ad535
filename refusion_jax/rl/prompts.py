"""GRPO's data: prompts with the columns their rewards read, checked up front, and batches of them (docs/rl.md §6).

A prompt record is a JSON object with a "query" (the prompt's text) and any other columns the rewards read (the
built-in rewards read "response" and "task"). `config.data.dataset` says where they come from:

- "tasks": the built-in tasks' training split (`inputs.open_splits`: {query, response, task});
- "json": `config.data.train_files`, comma-separated JSON files, each a list of records or one record a line
  (JSON Lines); every column of the records is kept (`read_prompt_records`).

Validation is the supervised loop's (exact match of decoding `config.eval`'s method on the validation split), so
"json" validation files are query/response files as for supervised training (`config.data.validation_files`).

Every record is checked before anything is built: a record that is no object, lacks a query, or whose prompt is
longer than `config.grpo.max_prompt_length` tokens is refused naming its file, its index and what to change
(`DataError`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import ml_collections

from refusion_jax.data.pipeline import DataError, decode_record
from refusion_jax.data.tokenizer import Tokenizer, format_prompt
from refusion_jax.training import inputs

# A step's prompts: the records of `config.batch_size` prompts (the global batch, in every process), each a dict
# of columns.
PromptBatch = list[dict[str, Any]]


def read_prompt_records(paths: Sequence[str]) -> list[dict[str, Any]]:
  """The records of JSON files (a list of objects, or JSON Lines), every column kept, each checked to be an object
  with a non-empty string "query".

  Raises:
    FileNotFoundError: a file that is not there.
    DataError: a file that is not JSON, or a record that is no object or has no usable query (file and index named).
  """
  records = []
  for path in paths:
    if not os.path.isfile(path):
      raise FileNotFoundError(f"No such prompt file: {path!r} (config.data.train_files).")
    with open(path, encoding="utf-8") as f:
      text = f.read()
    try:
      loaded = json.loads(text)
      items = loaded if isinstance(loaded, list) else [loaded]
    except json.JSONDecodeError:
      try:
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
      except json.JSONDecodeError as error:
        raise DataError(f"{path} is neither a JSON list of records nor JSON Lines: {error}.") from None
    for index, record in enumerate(items):
      records.append(check_prompt_record(record, f"{path} record {index}"))
  if not records:
    raise DataError(f"The prompt files {list(paths)} hold no records.")
  return records


def check_prompt_record(record: Any, where: str) -> dict[str, Any]:
  """`record` as a dict of columns with a non-empty string "query" (bytes fields decoded), else `DataError`."""
  if not isinstance(record, Mapping):
    raise DataError(f"{where} is a {type(record).__name__}, not an object with a 'query' and the rewards' columns.")
  record = decode_record(record)
  query = record.get("query")
  if not isinstance(query, str) or not query.strip():
    raise DataError(f"{where} has no 'query' (a non-empty string): {str(record)[:200]}.")
  return dict(record)


def open_prompt_splits(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Sequence[Any]]:
  """{"train": prompt records, "validation": query/response records (when configured)} of `config.data`."""
  if config.data.dataset == "json":
    splits: dict[str, Sequence[Any]] = {}
    if config.data.get("validation_files"):
      validation_only = ml_collections.ConfigDict(config.to_dict())
      validation_only.data.train_files = config.data.validation_files  # the builder needs a train split
      splits["validation"] = inputs.open_splits(validation_only, workdir)["validation"]
    files = [f for f in config.data.train_files.split(",") if f]
    splits["train"] = read_prompt_records(files)
    return splits
  return inputs.open_splits(config, workdir)


def check_prompt_lengths(
  records: Sequence[Any], tokenizer: Tokenizer, max_prompt_length: int, chat_template: bool, name: str
) -> None:
  """Every record's prompt fits `max_prompt_length` tokens, else `DataError` naming the first that does not."""
  for index in range(len(records)):
    record = check_prompt_record(records[index], f"{name} record {index}")
    length = len(tokenizer.encode(format_prompt(tokenizer, record["query"], chat_template)))
    if length > max_prompt_length:
      raise DataError(
        f"{name} record {index} has a prompt of {length} tokens, longer than config.grpo.max_prompt_length="
        f"{max_prompt_length}: raise --config.grpo.max_prompt_length or drop the record ({record['query'][:80]!r})."
      )


def prompt_batches(source: Sequence[Any], batch_size: int, seed: int) -> grain.IterDataset:
  """`source` as an endless, shuffled grain dataset of `batch_size`-record lists (`PromptBatch`; its iterator's
  position is checkpointed with the run), the same in every process.

  A multi-process run's processes each read the step's whole global batch (docs/rl.md §5), not a share: every
  process decodes every prompt of the step anyway (one engine over the run's mesh, fed the same prompts in every
  process), the rewards read the records' own columns (any JSON), which an exchange of fixed-shape arrays between
  processes would have to encode, and reading a step's few records is cheap next to decoding them. So the batches,
  their order and each process's checkpointed position are the one-process run's by construction.
  """
  dataset = grain.MapDataset.source(source).shuffle(seed=seed).repeat(None).map(decode_record)
  return dataset.to_iter_dataset().batch(batch_size, drop_remainder=True, batch_fn=list)


def columns_of(batch: PromptBatch, num_generations: int) -> tuple[list[str], dict[str, list[Any]]]:
  """The queries and the other columns of a batch's records, each repeated for the `num_generations` answers of its
  prompt (group-major), as reward functions take them. A column some records lack is None there."""
  names = sorted({name for record in batch for name in record if name != "query"})
  repeat = lambda values: [value for value in values for _ in range(num_generations)]
  queries = repeat([record["query"] for record in batch])
  return queries, {name: repeat([record.get(name) for record in batch]) for name in names}
