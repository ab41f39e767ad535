"""The grain input pipeline: raw {query, response} records -> fixed-shape token batches.

Order of operations (all deterministic given the seed):

    source -> shard (every shard_count-th record from shard_index) -> shuffle(seed)
      -> repeat(num_epochs; reshuffled each epoch) -> tokenise -> drop too long
      -> pad to seq_len, or pack several examples per row (best fit) -> [prefetch threads] -> batch

Batch contract (numpy int32), B = batch_size, L = seq_len:
    tokens      [B, L]  each row: its examples back to back, each prompt ++ response ++ EOS, then pad_id ...
    prompt_len  [B]     number of prompt tokens        ([B, K] with packing: per example of the row)
    answer_len  [B]     number of response tokens + 1 (the EOS)   ([B, K] with packing)
Unpacked rows hold one example each. Packed rows (`packing=True`, docs/method.md
§1) hold up to K = `max_segments` examples each, in the order of their lengths'
entries; unused entries are 0. A final partial batch (num_epochs set and
drop_remainder=False) is filled with rows of pad_id whose lengths are all 0.

Packing is grain's best-fit packer: `packing_bins` rows are filled at once,
each example going to the row it fits most tightly; when one fits none, those
rows are emitted (in a seeded random order) and filling starts again. More
bins leave less padding (`pad_fraction`); the iterator state stays exact
(a restored iterator packs the current bins again from their first example and
skips the rows already emitted).

Examples whose prompt + response + EOS exceed L are *dropped*, never truncated:
a truncated answer would teach the model to stop without EOS. During the first
pass over a shard each drop is counted (absl WARNING at the 1st, 2nd, 4th, ...
drop); once every record of the shard has been seen, a pass that kept nothing
is a `DataError` (naming the data, the drop count, the shortest example and the
seq_len to set) instead of an endless wait, and one that dropped more than
`warn_drop_fraction` of the records warns once with the same numbers. A record
without string "query" / "response" fields is a `DataError` naming it.
Dropping also means that, with a finite num_epochs, shards can yield different
numbers of batches: a multi-host loop over a finite pass should run a fixed
number of steps or use one process.

Checkpointing: `it = iter(dataset)` is a `grain.DatasetIterator`;
`it.get_state()` is a small JSON-serialisable dict and `it.set_state(state)`
on a fresh iterator of the same dataset resumes exactly. Inside an orbax
checkpoint use `grain.checkpoint.CheckpointSave(it)` /
`grain.checkpoint.CheckpointRestore(it)` (one JSON file per process), e.g. as
the "data" item of an `ocp.args.Composite`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import jax
import numpy as np
from absl import logging

from refusion_jax.data.tokenizer import Tokenizer, format_prompt

# Host arrays of the batch contract above, keyed tokens / prompt_len / answer_len: one row's, or a batch's.
HostArrays = dict[str, np.ndarray]

# Records are tiny and tokenising holds the GIL, so a few threads and a short
# read-ahead suffice; pass `read_options` to read from slow storage.
_DEFAULT_READ_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=256)


class DataError(ValueError):
  """Data that cannot be trained or evaluated on, named with what to change."""


def decode_record(record: Mapping[str, Any]) -> dict[str, str]:
  """A record with str or UTF-8 bytes fields (tfds Text features read back as bytes) -> str fields."""
  return {key: value.decode("utf-8") if isinstance(value, bytes) else value for key, value in record.items()}


class _Tokenize(grain.transforms.Map):
  """(source index, record) -> {"index": [], "prompt": int32 [P], "answer": int32 [A]}, EOS appended to the answer."""

  def __init__(self, tokenizer: Tokenizer, chat_template: bool, name: str):
    self._tokenizer = tokenizer
    self._chat_template = chat_template
    self._name = name

  def map(self, indexed: tuple[int, Mapping[str, Any]]) -> dict[str, Any]:
    index, record = indexed
    record = decode_record(record)
    bad = [key for key in ("query", "response") if not isinstance(record.get(key), str)]
    if bad:
      raise DataError(
        f"Record {index} of {self._name} has no string {' or '.join(map(repr, bad))} field "
        f"(fields: {sorted(record)}); every record needs string 'query' and 'response'."
      )
    query = format_prompt(self._tokenizer, record["query"], self._chat_template)
    answer = self._tokenizer.encode(record["response"]) + [self._tokenizer.eos_id]
    return {
      "index": index,
      "prompt": np.asarray(self._tokenizer.encode(query), np.int32),
      "answer": np.asarray(answer, np.int32),
    }


class _DropTooLong(grain.transforms.Filter):
  """Keeps examples whose prompt + answer fit in seq_len; judges the first pass over the shard.

  Grain calls `filter` from several reader threads and, repeating, from later
  epochs too; the first pass is over once every record of the shard (known by
  its source index) has been seen once.
  """

  def __init__(self, seq_len: int, shard: range, name: str, warn_drop_fraction: float):
    self._seq_len = seq_len
    self._shard = shard
    self._name = name
    self._warn_drop_fraction = warn_drop_fraction
    self._lock = threading.Lock()
    self._seen = np.zeros(len(shard), bool)
    self._count = self._kept = 0
    self._shortest_dropped, self._longest = None, 0

  def filter(self, example: Mapping[str, Any]) -> bool:
    length = len(example["prompt"]) + len(example["answer"])
    fits = length <= self._seq_len
    with self._lock:
      position = self._shard.index(example["index"])
      if not self._seen[position]:
        self._seen[position] = True
        self._first_pass(length, fits)
    return fits

  def _first_pass(self, length: int, fits: bool) -> None:
    self._count += 1
    self._kept += fits
    self._longest = max(self._longest, length)
    dropped = self._count - self._kept
    if not fits:
      self._shortest_dropped = min(length, self._shortest_dropped or length)
      if dropped & (dropped - 1) == 0:
        logging.warning(
          "Dropped %d example(s) longer than seq_len=%d so far (this one: %d tokens).", dropped, self._seq_len, length
        )
    if self._count < len(self._shard):
      return
    summary = (
      f"{dropped} of the {self._count} examples of {self._name} are longer than seq_len={self._seq_len} "
      f"(prompt + answer + EOS tokens; the shortest dropped has {self._shortest_dropped}, the longest example "
      f"{self._longest})"
    )
    advice = f"raise seq_len to at least {self._shortest_dropped} ({self._longest} keeps every example)"
    if not self._kept:
      raise DataError(f"Nothing to train or evaluate on: {summary}. Shorten the examples, or {advice}.")
    if dropped > self._warn_drop_fraction * self._count:
      logging.warning("%s and are dropped; to keep them, %s.", summary, advice)


class _PadToLength(grain.transforms.Map):
  """{"prompt", "answer"} -> {"tokens": int32 [L], "prompt_len": int32 [], "answer_len": int32 []}."""

  def __init__(self, seq_len: int, pad_id: int):
    self._seq_len = seq_len
    self._pad_id = pad_id

  def map(self, example: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    tokens = np.full(self._seq_len, self._pad_id, np.int32)
    prompt, answer = example["prompt"], example["answer"]
    tokens[: len(prompt)] = prompt
    tokens[len(prompt) : len(prompt) + len(answer)] = answer
    return {"tokens": tokens, "prompt_len": np.int32(len(prompt)), "answer_len": np.int32(len(answer))}


class _Concatenate(grain.transforms.Map):
  """{"prompt", "answer"} -> {"tokens": int32 [P + A], "prompt_len": int32 [1], "answer_len": int32 [1]}, to pack."""

  def map(self, example: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    prompt, answer = example["prompt"], example["answer"]
    return {
      "tokens": np.concatenate([prompt, answer]),
      "prompt_len": np.asarray([len(prompt)], np.int32),
      "answer_len": np.asarray([len(answer)], np.int32),
    }


def _stack_and_fill(rows: Sequence[HostArrays], batch_size: int, seq_len: int, pad_id: int) -> HostArrays:
  """Stacks rows into a batch of exactly batch_size, filling with empty rows (packing's extra fields dropped)."""
  fill = batch_size - len(rows)
  lengths = np.zeros((fill, *np.shape(rows[0]["prompt_len"])), np.int32)
  return {
    "tokens": np.concatenate([np.stack([row["tokens"] for row in rows]), np.full((fill, seq_len), pad_id, np.int32)]),
    "prompt_len": np.concatenate([np.stack([row["prompt_len"] for row in rows]), lengths]).astype(np.int32),
    "answer_len": np.concatenate([np.stack([row["answer_len"] for row in rows]), lengths]).astype(np.int32),
  }


def pad_fraction(batch: Mapping[str, np.ndarray]) -> float:
  """The share of a batch's row positions that hold no example (padding after packed or unpacked examples)."""
  return 1.0 - float(np.sum(batch["prompt_len"]) + np.sum(batch["answer_len"])) / np.size(batch["tokens"])


def make_dataset(
  source: Sequence[Mapping[str, Any]],
  tokenizer: Tokenizer,
  *,
  seq_len: int,
  batch_size: int,
  seed: int,
  shuffle: bool = True,
  num_epochs: int | None = None,
  shard_index: int | None = None,
  shard_count: int | None = None,
  chat_template: bool = False,
  drop_remainder: bool = False,
  read_options: grain.ReadOptions | None = None,
  name: str = "the data",
  warn_drop_fraction: float = 0.1,
  packing: bool = False,
  max_segments: int = 16,
  packing_bins: int = 128,
) -> grain.IterDataset:
  """A grain dataset of token batches (see the module docstring for the contract).

  Args:
    source: random-access records with "query" and "response" (str or UTF-8
      bytes), e.g. a split from `build_refusion_tasks` / `tfds.data_source`, or
      a list of dicts.
    tokenizer: encodes text; its pad_id fills and eos_id ends each answer.
    seq_len: static length L of every row.
    batch_size: rows per batch B (per process).
    seed: shuffle seed; each epoch is reshuffled from it.
    shuffle: False keeps the source order (within the shard).
    num_epochs: passes over the data; None repeats forever.
    shard_index, shard_count: this process's shard; default
      `jax.process_index()` of `jax.process_count()`.
    chat_template: wrap each query with `tokenizer.apply_chat_template`.
    drop_remainder: drop a final partial batch instead of filling it.
    read_options: grain reader threads and read-ahead.
    name: what the data is, for messages (e.g. "the training data (train.json)").
    warn_drop_fraction: warn once when the first pass drops more than this
      share of the shard's records for being longer than seq_len.
    packing: pack several examples per row (see the module docstring).
    max_segments: with packing, at most this many examples per row (K).
    packing_bins: with packing, rows filled at once.

  Returns:
    A `grain.IterDataset`; `iter()` of it is a checkpointable `grain.DatasetIterator`.
  """
  # Resolved here, not as defaults: jax.process_index() initialises the backend.
  shard_index = jax.process_index() if shard_index is None else shard_index
  shard_count = jax.process_count() if shard_count is None else shard_count
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index={shard_index} must be in [0, shard_count={shard_count}).")
  if seq_len < 2 or batch_size < 1:
    raise ValueError(f"Need seq_len >= 2 and batch_size >= 1, got seq_len={seq_len}, batch_size={batch_size}.")
  if packing and (max_segments < 1 or packing_bins < 1):
    raise ValueError(
      f"Packing needs max_segments >= 1 and packing_bins >= 1, got max_segments={max_segments}, "
      f"packing_bins={packing_bins}."
    )
  if num_epochs is not None and num_epochs < 1:
    raise ValueError(f"num_epochs={num_epochs}; pass a positive count, or None to repeat forever.")
  if not len(source):
    raise DataError(f"{name} has no records.")
  if len(source) < shard_count:
    raise ValueError(f"The source has {len(source)} records, fewer than shard_count={shard_count}.")

  shard = range(shard_index, len(source), shard_count)
  # Records keep their source index through the shuffle: messages name it, and the filter knows a pass by it.
  # Repeated epochs reach the source with indices past its end, read modulo its length.
  size = len(source)
  dataset = grain.MapDataset.source(source).map_with_index(lambda index, record: (index % size, record))
  dataset = dataset[shard_index::shard_count]
  if shuffle:
    dataset = dataset.shuffle(seed=seed)
  if num_epochs != 1:
    dataset = dataset.repeat(num_epochs)
  dataset = dataset.map(_Tokenize(tokenizer, chat_template, name)).filter(
    _DropTooLong(seq_len, shard, name, warn_drop_fraction)
  )
  read_options = read_options or _DEFAULT_READ_OPTIONS
  if packing:
    rows = grain.experimental.BestFitPackIterDataset(
      dataset.map(_Concatenate()).to_iter_dataset(read_options),
      length_struct={"tokens": seq_len, "prompt_len": max_segments, "answer_len": max_segments},
      padding_struct={"tokens": tokenizer.pad_id, "prompt_len": 0, "answer_len": 0},
      num_packing_bins=packing_bins,
      seed=seed,
      shuffle_bins=shuffle,
    )
  else:
    rows = dataset.map(_PadToLength(seq_len, tokenizer.pad_id)).to_iter_dataset(read_options)
  return rows.batch(
    batch_size,
    drop_remainder=drop_remainder,
    batch_fn=lambda rows: _stack_and_fill(rows, batch_size, seq_len, tokenizer.pad_id),
  )


def batch_prompts_and_answers(batch: Mapping[str, np.ndarray]) -> tuple[list[list[int]], list[list[int]]]:
  """Per example of a batch (packed rows: each of their examples in turn), its prompt ids and its answer ids.

  Empty entries (prompt_len = answer_len = 0: fill rows, unused segments) are skipped.
  """
  tokens = np.asarray(batch["tokens"])
  prompt_lens, answer_lens = (np.asarray(batch[key]).reshape(len(tokens), -1) for key in ("prompt_len", "answer_len"))
  prompts, answers = [], []
  for row, row_prompts, row_answers in zip(tokens, prompt_lens, answer_lens):
    start = 0
    for prompt_len, answer_len in zip(row_prompts, row_answers):
      if prompt_len == 0 and answer_len == 0:
        continue
      prompts.append(row[start : start + prompt_len].tolist())
      answers.append(row[start + prompt_len : start + prompt_len + answer_len].tolist())
      start += prompt_len + answer_len
  return prompts, answers
