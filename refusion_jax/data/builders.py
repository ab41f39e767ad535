"""tensorflow-datasets builders that write raw text examples to array_record, read back with `tfds.data_source`.

No TensorFlow is needed: `GeneratorBasedBuilder` with `file_format="array_record"`
serialises `tfds.features.Text` features with numpy only, and
`tfds.data_source` / `builder.as_data_source()` reads them back as random-access
sequences of {"query": bytes, "response": bytes, "task": bytes} (Text decodes to
UTF-8 bytes without TensorFlow). Tokenisation happens later, in the pipeline.

Two datasets:
- `query_response_json`: the released ReFusion format, JSON files holding a list
  of {"query", "response"} objects (JSON Lines, one object a line, also works).
- `refusion_tasks`: the built-in verifiable tasks of `tasks.py`.

Configs are named from their contents (sizes and seed; file paths, sizes and
modification times), so changing the data builds a new dataset directory instead
of silently reusing a stale one. Use `build_refusion_tasks` /
`build_query_response_json`; the builders themselves also work by name:

    tfds.data_source("refusion_tasks/tiny", data_dir=d,
                     builder_kwargs={"file_format": "array_record"})
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence

import tensorflow_datasets as tfds

from refusion_jax.data import tasks
from refusion_jax.data.pipeline import DataError, decode_record

_FILE_FORMAT = "array_record"


def _features() -> tfds.features.FeaturesDict:
  return tfds.features.FeaturesDict(
    {"query": tfds.features.Text(), "response": tfds.features.Text(), "task": tfds.features.Text()}
  )


# Built-in tasks -------------------------------------------------------------


@dataclasses.dataclass
class ReFusionTasksConfig(tfds.core.BuilderConfig):
  """Sizes of the splits of the built-in tasks, the generation seed and the task list."""

  num_train: int = 20_000
  num_validation: int = 1_000
  num_test: int = 1_000
  seed: int = 0
  tasks: tuple[str, ...] = tasks.TASKS


class ReFusionTasks(tfds.core.GeneratorBasedBuilder):
  """The built-in verifiable tasks (see `refusion_jax.data.tasks`), train/validation/test."""

  name = "refusion_tasks"
  VERSION = tfds.core.Version("1.0.0")
  BUILDER_CONFIGS = [
    ReFusionTasksConfig(name="default", description="20k train / 1k validation / 1k test."),
    ReFusionTasksConfig(name="tiny", num_train=512, num_validation=64, num_test=64, description="For smoke tests."),
  ]

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(builder=self, features=_features(), description=tasks.__doc__)

  def _split_generators(self, dl_manager):
    del dl_manager  # generated locally
    config = self.builder_config
    sizes = {"train": config.num_train, "validation": config.num_validation, "test": config.num_test}
    return {split: self._generate_examples(split, size) for split, size in sizes.items() if size > 0}

  def _generate_examples(self, split: str, size: int) -> Iterator[tuple[int, dict[str, str]]]:
    config = self.builder_config
    yield from enumerate(tasks.generate_examples(split, size, seed=config.seed, tasks=config.tasks))


def _content_name(prefix: str, *parts) -> str:
  return f"{prefix}_{hashlib.sha256(repr(parts).encode()).hexdigest()[:12]}"


def build_refusion_tasks(
  data_dir: str,
  *,
  num_train: int = 20_000,
  num_validation: int = 1_000,
  num_test: int = 1_000,
  seed: int = 0,
  task_names: Sequence[str] = tasks.TASKS,
) -> dict[str, Sequence[dict[str, bytes]]]:
  """Builds the built-in tasks under `data_dir` (once) and returns {split: data source}."""
  task_names = tuple(task_names)
  sizes = (num_train, num_validation, num_test)
  config = ReFusionTasksConfig(
    name=_content_name("n" + "_".join(map(str, sizes)), seed, task_names),
    num_train=num_train,
    num_validation=num_validation,
    num_test=num_test,
    seed=seed,
    tasks=task_names,
  )
  return _prepare(ReFusionTasks, config, data_dir)


# User JSON files ------------------------------------------------------------


@dataclasses.dataclass
class QueryResponseJsonConfig(tfds.core.BuilderConfig):
  """{split name: JSON files}; each file a list of {"query", "response"[, "task"]} objects."""

  split_files: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


def _json_lines(text: str, path: str) -> list:
  records = []
  for number, line in enumerate(text.splitlines(), 1):
    if line.strip():
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError as error:
        raise DataError(f"{path}, line {number}: not valid JSON ({error}).") from None
  return records


def _read_records(path: str) -> list:
  """The records of one file: a JSON list (the release's `train_data.json`), or JSON Lines.

  A `.jsonl` file is JSON Lines; so is a `.json` file holding one JSON value
  per line, which the release's loader (Hugging Face `datasets`' json) reads too.
  """
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except UnicodeDecodeError as error:
    raise DataError(f"{path} is not UTF-8 text (byte {error.start}: {error.reason}); save it as UTF-8 JSON.") from None
  if not text.strip():
    raise DataError(f'{path} is empty; expected a JSON list of {{"query", "response"}} objects.')
  if path.endswith(".jsonl"):
    return _json_lines(text, path)
  try:
    records = json.loads(text)
  except json.JSONDecodeError as error:
    if error.msg == "Extra data":  # a first value parsed, then more: one value per line
      return _json_lines(text, path)
    raise DataError(
      f'{path} is not valid JSON ({error}); expected a list of {{"query", "response"}} objects.'
    ) from None
  if not isinstance(records, list):
    raise DataError(
      f'{path} holds a JSON {type(records).__name__}; expected a list of {{"query", "response"}} objects.'
    )
  return records


def _check_record(record, path: str, index: int) -> dict[str, str]:
  if not isinstance(record, dict):
    raise DataError(f"{path}, record {index}: a JSON {type(record).__name__}, expected an object.")
  for key in ("query", "response"):
    if key not in record:
      raise DataError(f"{path}, record {index}: no {key!r} field (fields: {sorted(record)}).")
    if not isinstance(record[key], str):
      raise DataError(f"{path}, record {index}: {key!r} is a JSON {type(record[key]).__name__}, expected a string.")
  return {"query": record["query"], "response": record["response"], "task": str(record.get("task", ""))}


def _read_split(files: Sequence[str]) -> list[tuple[str, dict[str, str]]]:
  """(key, example) of every record of a split's files, checked; a split without records is an error."""
  examples = [
    (f"{path}:{index}", _check_record(record, path, index))
    for path in files
    for index, record in enumerate(_read_records(path))
  ]
  if not examples:
    verb = "holds" if len(files) == 1 else "hold"
    raise DataError(f"{', '.join(files)} {verb} no records; a split needs at least one query/response object.")
  return examples


class QueryResponseJson(tfds.core.GeneratorBasedBuilder):
  """Query/response pairs from JSON files (the released ReFusion training data format)."""

  name = "query_response_json"
  VERSION = tfds.core.Version("1.0.0")

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(builder=self, features=_features(), description=self.__doc__)

  def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Iterator]:
    del dl_manager  # local files
    split_files = self.builder_config.split_files
    if not split_files:
      raise ValueError("QueryResponseJsonConfig.split_files is empty; map a split name to its JSON files.")
    # Every file is read and checked before tfds writes anything: our errors, never a failed tfds write.
    return {split: self._generate_examples(_read_split(files)) for split, files in split_files.items()}

  def _generate_examples(self, examples: list[tuple[str, dict[str, str]]]) -> Iterator[tuple[str, dict[str, str]]]:
    yield from examples


def build_query_response_json(
  data_dir: str, split_files: Mapping[str, Sequence[str]]
) -> dict[str, Sequence[dict[str, bytes]]]:
  """Builds {split: JSON files} into array_record under `data_dir` (once per file content).

  Returns:
    {split: data source}.
  """
  resolved = {}
  for split, files in split_files.items():
    paths = tuple(os.path.abspath(path) for path in ([files] if isinstance(files, str) else files))
    missing = [path for path in paths if not os.path.isfile(path)]
    if missing:
      raise FileNotFoundError(f"Split {split!r}: no such JSON file(s): {missing}.")
    resolved[split] = paths
  stamps = sorted(
    (split, path, os.stat(path).st_size, os.stat(path).st_mtime_ns)
    for split, paths in resolved.items()
    for path in paths
  )
  config = QueryResponseJsonConfig(name=_content_name("files", stamps), split_files=resolved)
  return _prepare(QueryResponseJson, config, data_dir)


def read_query_response_json(path: str) -> list[dict[str, str]]:
  """The {query, response, task} records of one JSON file, read and checked exactly as training reads its files
  (built into a temporary array_record data set)."""
  with tempfile.TemporaryDirectory() as data_dir:
    source = build_query_response_json(data_dir, {"test": [path]})["test"]
    return [decode_record(source[i]) for i in range(len(source))]


def _prepare(builder_cls, config, data_dir: str) -> dict[str, Sequence[dict[str, bytes]]]:
  return tfds.data_source(
    builder_cls.name,
    data_dir=data_dir,
    builder_kwargs={"config": config, "file_format": _FILE_FORMAT},
  )
