"""The one place evaluation reaches into the decoders, the checkpoint loaders, the data and the checker.

Each function is a thin adapter over today's API, so that when those modules
move (one decode front end, a checkpoint front door, the exact-match checker in
`training/evaluate.py`, a prompt-format helper in `data/`) only this file changes.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence

from refusion_jax.checkpoints.load import load
from refusion_jax.data import tasks
from refusion_jax.data.pipeline import decode_record
from refusion_jax.data.tokenizer import Tokenizer, format_prompt
from refusion_jax.decoding import driver, sampler
from refusion_jax.decoding.result import DecodeResult
from refusion_jax.model.transformer import Transformer
from refusion_jax.training.evaluate import is_correct as _is_correct

METHODS = tuple(sorted(sampler.METHODS))


def load_checkpoint(path: str, step: int | None = None, tokenizer: str | None = None) -> tuple[Transformer, Tokenizer]:
  """The model and tokenizer of a Hugging Face directory (config.json + safetensors) or a training workdir.

  `tokenizer` overrides the checkpoint's own ("bytes" or a directory with tokenizer.json).
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f"--checkpoint {path!r} does not exist; pass a training workdir or a HF directory.")
  return load(path, step=step, tokenizer=tokenizer)


def decode(
  model: Transformer, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]], method: str, knobs: dict
) -> DecodeResult:
  """Decode token-id prompts (one batch) with `method` and its decoder's keyword arguments `knobs`."""
  return sampler.Sampler(model, tokenizer, method=method, **knobs).decode_ids(prompts)


def decode_options(method: str) -> list[str]:
  """The keyword arguments `method`'s decoder takes."""
  return sampler.decoder_options(sampler.METHODS[method])


def compile_count() -> int:
  """Decode programs compiled so far in this process (ReFusion and the baselines together)."""
  return driver.compile_count()


def is_correct(example: dict, answer: str) -> bool:
  """The training evaluation's checker: built-in tasks re-solved, other data exact match up to whitespace."""
  return _is_correct(example, answer)


def prompt_ids(tokenizer: Tokenizer, query: str, chat_template: bool) -> list[int]:
  """The prompt the training pipeline builds for `query` (chat template or the raw query)."""
  return tokenizer.encode(format_prompt(tokenizer, query, chat_template))


def task_examples(split: str, count: int, *, seed: int, task_names: Sequence[str]) -> list[dict[str, str]]:
  """The built-in task examples the training data build writes into `split` (its first `count`)."""
  return tasks.generate_examples(split, count, seed=seed, tasks=tuple(task_names))


def json_examples(path: str) -> list[dict[str, str]]:
  """The {query, response, task} records of a query/response JSON file, read as training reads its files."""
  from refusion_jax.data import builders  # imports tensorflow-datasets: only for JSON test sets

  with tempfile.TemporaryDirectory() as data_dir:
    source = builders.build_query_response_json(data_dir, {"test": [path]})["test"]
    return [decode_record(source[i]) for i in range(len(source))]
