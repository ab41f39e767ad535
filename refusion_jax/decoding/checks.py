"""Input checks a method value runs when it is built and every decode runs before anything compiles.

Each check raises a `ValueError` that names the bad field or value and what
to use instead: prompts that are empty, not integer ids, outside the
vocabulary or too long for the model; thresholds, temperature, counts, slot
layout; special ids the model does not know.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from refusion_jax.data.special_tokens import SpecialTokens, resolve_special_tokens
from refusion_jax.model.config import ModelConfig

# An id no token has: "no EOS known" simply never matches (the baselines run without one).
NO_TOKEN = -1


def check_prompts(prompts: Sequence[Sequence[int]], config: ModelConfig, gen_length: int) -> None:
  """Reject empty prompts, ids outside the vocabulary and over-long requests."""
  if isinstance(prompts, (str, bytes)) or not len(prompts):
    raise ValueError("prompt_ids must be a non-empty list of token-id lists, e.g. [[1, 2, 3]].")
  if gen_length < 1:
    raise ValueError(f"gen_length={gen_length} must be at least 1.")
  for row, prompt in enumerate(prompts):
    if isinstance(prompt, (int, np.integer)):
      raise ValueError("prompt_ids must be a list of lists (one list per batch row), got a flat list of ints.")
    if len(prompt) == 0:
      raise ValueError(f"Prompt {row} is empty; every row needs at least one token.")
    ids = _integer_ids(row, prompt)
    bad = ids[(ids < 0) | (ids >= config.vocab_size)]
    if bad.size:
      raise ValueError(f"Prompt {row} has token id {int(bad[0])} outside the vocabulary [0, {config.vocab_size}).")
    total = len(prompt) + gen_length
    if total > config.max_position_embeddings:
      raise ValueError(
        f"Prompt {row} has {len(prompt)} tokens; with gen_length={gen_length} that is {total} "
        f"positions, more than the model's maximum {config.max_position_embeddings}. "
        f"Shorten the prompt or lower gen_length to at most {config.max_position_embeddings - len(prompt)}."
      )


def _integer_ids(row: int, prompt: Sequence[int]) -> np.ndarray:
  """Prompt `row` as a 1-D integer array; floats, bools and nested lists are refused, not rounded."""
  ids = np.asarray(prompt)
  is_bool = ids.dtype == bool or any(isinstance(t, (bool, np.bool_)) for t in prompt)
  if ids.ndim != 1 or ids.dtype.kind not in "iu" or is_bool:
    example = next((t for t in prompt if is_bool or not isinstance(t, (int, np.integer))), prompt[0])
    raise ValueError(
      f"Prompt {row} must be a flat list of integer token ids, got {example!r} (as array: dtype {ids.dtype}, "
      f"{ids.ndim}-D). Pass ints, e.g. [[1, 2, 3]]; convert a float array that holds ids with .astype(int)."
    )
  return ids


def check_special_id(name: str, value: int | None, config: ModelConfig) -> int:
  """A special token id that must exist and lie inside the vocabulary."""
  if value is None:
    raise ValueError(
      f"No {name} is known for this model: pass {name}=... explicitly "
      f"(the checkpoint's config and tokenizer did not define one)."
    )
  if not 0 <= value < config.vocab_size:
    raise ValueError(f"{name}={value} lies outside the vocabulary [0, {config.vocab_size}).")
  return int(value)


def _is_number(value: object) -> bool:
  return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def check_threshold(name: str, value: float) -> float:
  if not _is_number(value) or not 0.0 < value <= 1.0:
    raise ValueError(f"{name}={value!r} must lie in (0, 1] (a number), e.g. {name}=0.9.")
  return float(value)


def check_temperature(temperature: float) -> float:
  if not _is_number(temperature) or temperature < 0:
    raise ValueError(f"temperature={temperature!r} must be >= 0 (a number; 0 means greedy), e.g. temperature=0.0.")
  return float(temperature)


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
  if value not in choices:
    raise ValueError(f"{name}={value!r} must be one of {', '.join(repr(c) for c in choices)}.")


def check_sampling_filters(top_k: int, top_p: float, min_p: float) -> None:
  """A request's sampling filters (`scoring.SamplingRule`): top_k an integer >= 0 (0: off), top_p in (0, 1] (1:
  off), min_p in [0, 1] (0: off)."""
  if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
    raise ValueError(f"top_k={top_k!r} must be an integer >= 0 (0 keeps every token), e.g. top_k=50.")
  if not _is_number(top_p) or not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p={top_p!r} must lie in (0, 1] (1 keeps every token), e.g. top_p=0.95.")
  if not _is_number(min_p) or not 0.0 <= min_p <= 1.0:
    raise ValueError(f"min_p={min_p!r} must lie in [0, 1] (0 keeps every token), e.g. min_p=0.05.")


def check_count(name: str, value: int, example: int) -> None:
  """A method's count (answer length, slot size, steps) must be a positive integer; `example` is one to use."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name}={value!r} must be a positive integer, e.g. {name}={example}.")


def check_flag(name: str, value: bool) -> None:
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name}={value!r} must be True or False.")


def check_positive(name: str, value: int | None, none_means: str) -> None:
  """An optional count (rows, iterations) must be a positive integer; None means `none_means`."""
  if value is not None and (
    isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1
  ):
    raise ValueError(f"{name}={value!r} must be a positive integer (or None: {none_means}).")


def check_slot_layout(gen_length: int, slot_size: int, serial_blocks: int) -> None:
  """ReFusion splits G into serial blocks of whole slots: G must be a multiple of S × NB."""
  if slot_size < 1:
    raise ValueError(f"slot_size={slot_size} must be at least 1 (the paper uses 4, 8, 16 or 32).")
  if serial_blocks < 1:
    raise ValueError(f"serial_blocks={serial_blocks} must be at least 1.")
  unit = slot_size * serial_blocks
  if gen_length % unit:
    nearest = max(unit, unit * round(gen_length / unit))
    raise ValueError(
      f"gen_length={gen_length} must be a multiple of slot_size × serial_blocks = {unit}; "
      f"use gen_length={nearest}, or change slot_size / serial_blocks."
    )


def decoder_special_tokens(
  config: ModelConfig, *, mask_id: int | None = None, eos_id: int | None = None, pad_id: int | None = None
) -> SpecialTokens:
  """The ids a decoder uses: the given ones, else the model config's (`resolve_special_tokens`).

  The pad id falls back to the EOS, then to 0: padding is never attended.
  """
  ids = resolve_special_tokens(SpecialTokens(mask=mask_id, eos=eos_id, pad=pad_id), config=config)
  return dataclasses.replace(ids, pad=0 if ids.padding is None else ids.padding)


def optional_eos_id(eos_id: int | None, config: ModelConfig) -> int:
  """The checked EOS id (given, else the config's), or `NO_TOKEN` when neither names one."""
  eos_id = decoder_special_tokens(config, eos_id=eos_id).eos
  return NO_TOKEN if eos_id is None else check_special_id("eos_id", eos_id, config)


def check_method(method: Any) -> None:
  """Refuse what is not a method value (a method name, a class, a dict of knobs)."""
  if isinstance(method, type) or not callable(getattr(method, "decoder", None)):
    raise ValueError(
      f"method={method!r} is not a decoding method value: pass one such as refusion_jax.ReFusion(gen_length=64), "
      "refusion_jax.AR(gen_length=64) or refusion_jax.MDM(gen_length=64)."
    )
