"""What every decoder shares: input checks, prompt buckets and the result type.

ReFusion (`refusion_jax.decoding.refusion`), its eager reference and the AR / MDM
baselines (`refusion_jax.decoding.baselines`) all take token-id prompts, reject bad
input before anything is compiled, pad prompts into a few length buckets so
new prompts do not recompile, and return a `DecodeResult`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from refusion_jax.data.special_tokens import SpecialTokens, resolve_special_tokens
from refusion_jax.model.config import ModelConfig

# Prompt lengths are padded up to the smallest bucket that holds them.
PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

# Phase codes recorded in `DecodeResult.commit_phase`.
PHASE_NONE = -1
PHASE_VERIFY = 0  # committed as a whole slot by the global verification (docs/method.md §2 step 2)
PHASE_INFILL = 1  # committed after parallel infill (step 3)
PHASE_STEP = 2  # baselines: committed by an AR step or an MDM unmasking step
PHASE_NAMES = {PHASE_VERIFY: "verify", PHASE_INFILL: "infill", PHASE_STEP: "step"}


@dataclasses.dataclass
class DecodeResult:
  """The output of a decode call over a batch of B prompts.

  Attributes:
    tokens: per row, the generated answer read back by true position, up to and
      including the first EOS (the whole generation when there is none).
    num_forwards: [B] model forwards each row took part in before it finished.
    steps: [B] decode iterations per row (ReFusion: plan steps; AR: tokens;
      MDM: unmasking steps).
    commit_iteration: [B, G] the iteration (0-based) that committed each
      answer position, -1 where nothing was committed.
    commit_phase: [B, G] how each position was committed (`PHASE_*`).
    seconds: wall-clock time of the call, compilation included when it happened.
  """

  tokens: list[list[int]]
  num_forwards: np.ndarray
  steps: np.ndarray
  commit_iteration: np.ndarray
  commit_phase: np.ndarray
  seconds: float = 0.0

  @property
  def tpf(self) -> np.ndarray:
    """[B] answer tokens ÷ model forwards, per row."""
    lengths = np.array([len(t) for t in self.tokens], np.float64)
    return lengths / np.maximum(self.num_forwards, 1)

  @property
  def overall_tpf(self) -> float:
    """All rows' answer tokens ÷ all rows' forwards."""
    return float(sum(len(t) for t in self.tokens) / max(int(np.sum(self.num_forwards)), 1))

  def trace(self, row: int = 0) -> list[tuple[int, int, int, str]]:
    """(position, token, iteration, phase name) of every answer token of `row`."""
    return [
      (pos, tok, int(self.commit_iteration[row, pos]), PHASE_NAMES.get(int(self.commit_phase[row, pos]), "none"))
      for pos, tok in enumerate(self.tokens[row])
    ]


def bucket_length(length: int, buckets: Sequence[int] = PROMPT_BUCKETS) -> int:
  """The smallest bucket that holds `length` tokens."""
  for bucket in buckets:
    if length <= bucket:
      return bucket
  raise ValueError(f"A prompt of {length} tokens is longer than the largest bucket ({buckets[-1]}).")


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, buckets: Sequence[int] = PROMPT_BUCKETS):
  """Right-pad prompts into one bucket.

  Returns:
    tokens [B, bucket] int32 and lengths [B] int32.
  """
  lengths = np.array([len(p) for p in prompts], np.int32)
  width = bucket_length(int(lengths.max()), buckets)
  tokens = np.full((len(prompts), width), pad_id, np.int32)
  for row, prompt in enumerate(prompts):
    tokens[row, : len(prompt)] = prompt
  return tokens, lengths


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
    ids = np.asarray(prompt)
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


def check_threshold(name: str, value: float) -> float:
  if not 0.0 < value <= 1.0:
    raise ValueError(f"{name}={value} must lie in (0, 1].")
  return float(value)


def check_temperature(temperature: float) -> float:
  if temperature < 0:
    raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy).")
  return float(temperature)


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


def answer_tokens(out: np.ndarray, eos_id: int) -> list[list[int]]:
  """Per row of `out` [B, G] (ids by true position), the answer up to and including the first EOS."""
  rows = []
  for row in np.asarray(out).tolist():
    rows.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
  return rows


def decoder_special_tokens(
  config: ModelConfig, *, mask_id: int | None = None, eos_id: int | None = None, pad_id: int | None = None
) -> SpecialTokens:
  """The ids a decoder uses: the given ones, else the model config's (`resolve_special_tokens`).

  The pad id falls back to the EOS, then to 0: padding is never attended.
  """
  ids = resolve_special_tokens(SpecialTokens(mask=mask_id, eos=eos_id, pad=pad_id), config=config)
  return dataclasses.replace(ids, pad=0 if ids.padding is None else ids.padding)


def row_gumbel_noise(key: jax.Array, steps: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Gumbel noise [B, *shape]; row b at its step s_b draws from fold_in(fold_in(key, b), s_b).

  Keying the noise by row and step keeps sampled decoding reproducible however
  the rows of a batch advance.
  """
  rows = np.arange(steps.shape[0])
  keys = jax.vmap(lambda row, step: jax.random.fold_in(jax.random.fold_in(key, row), step))(rows, steps)
  return jax.vmap(lambda k: jax.random.gumbel(k, shape, jax.numpy.float32))(keys)


def blank_after_answer(answers: list[list[int]], iteration: np.ndarray, phase: np.ndarray):
  """Commit iteration and phase [B, G] with every position past each row's answer set to none."""
  answered = np.arange(iteration.shape[1])[None, :] < np.array([len(a) for a in answers])[:, None]
  return np.where(answered, iteration, -1), np.where(answered, phase, PHASE_NONE)
