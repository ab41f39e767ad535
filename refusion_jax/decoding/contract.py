"""The decoder contract: what a decoding method hands the one compiled loop (docs/architecture.md §4).

A decoding method (ReFusion, AR, MDM) is a `Method`: how to start K idle
rows, how to admit a queued prompt into one idle row, and how to step every
row. The loop (`batching.run_rows`, jitted as `driver.decode_loop`) does the
rest: which row takes which prompt, when to hand back to the host, where the
outputs go. Each method names its parts alike: `XSettings` (static, hashable:
what fixes the compiled program), `XKnobs` (traced: thresholds, PRNG key,
ids), `start_rows`, `_admit`, `_step`, and the `Method` itself.

Shapes: K rows, Q queue entries (`batching.queue_entries(K)`), P the prompt
bucket, G the answer length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Generic, Protocol, TypeVar

import jax
import numpy as np

from refusion_jax.decoding.batching import DecodeOutputs
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer


class Settings(Hashable, Protocol):
  """A method's static settings: a frozen dataclass (a static jit argument), with the answer length."""

  @property
  def gen_length(self) -> int: ...


# The per-row state: a pytree whose leaves lead with the row axis K (a `KVCache` in it holds K on axis 1).
RowsT = TypeVar("RowsT")
SettingsT = TypeVar("SettingsT", bound=Settings)
# The traced knobs: a pytree of arrays (`flax.struct.dataclass`).
KnobsT = TypeVar("KnobsT")


class StartRows(Protocol[SettingsT, RowsT]):
  def __call__(
    self, settings: SettingsT, config: ModelConfig, rows: int, prompt_width: int
  ) -> tuple[RowsT, np.ndarray]:
    """K = `rows` idle rows for prompts of P = `prompt_width`, and zero width counters.

    Returns:
      (rows, widths): the per-row state and [len(width_names), largest width + 1] int32 counts of
      forwards by query width, both host arrays (`batching.host_zeros`): starting dispatches nothing.
    """
    ...


class Admit(Protocol[KnobsT, SettingsT, RowsT]):
  def __call__(
    self,
    model: Transformer,
    knobs: KnobsT,
    settings: SettingsT,
    rows: RowsT,
    out: DecodeOutputs,
    row: jax.Array,
    entry: jax.Array,
    prompt: jax.Array,
    tokens: jax.Array,
    length: jax.Array,
  ) -> tuple[RowsT, DecodeOutputs]:
    """Start a queued prompt in an idle row (traced inside the loop).

    Args:
      row: [] int32 the idle row that takes the prompt.
      entry: [] int32 the prompt's queue entry: its outputs go to `out` there.
      prompt: [] int32 the prompt's index in the call's input (what noise keys fold in).
      tokens: [P] int32 the right-padded prompt.
      length: [] int32 its true length.

    Returns:
      rows with row `row` reset to decode the prompt, and `out` with what the admission did (a prefill
      counted as a forward of the entry).
    """
    ...


class Step(Protocol[KnobsT, SettingsT, RowsT]):
  def __call__(
    self,
    model: Transformer,
    knobs: KnobsT,
    settings: SettingsT,
    rows: RowsT,
    out: DecodeOutputs,
    widths: jax.Array,
    live: jax.Array,
    entry: jax.Array,
    prompt: jax.Array,
  ) -> tuple[RowsT, DecodeOutputs, jax.Array, jax.Array]:
    """One decode iteration of every row (traced inside the loop).

    Args:
      widths: [len(width_names), largest width + 1] int32 forwards counted by query width.
      live: [K] bool the rows decoding a prompt.
      entry: [K] int32 each row's queue entry, Q on idle rows (so their writes to `out` drop).
      prompt: [K] int32 each row's prompt index in the call's input.

    Returns:
      (rows, out, widths with this iteration's forwards counted, finished [K] bool: live rows whose
      answer is done, which turn idle).
    """
    ...


@dataclasses.dataclass(frozen=True)
class Method(Generic[SettingsT, KnobsT, RowsT]):
  """A decoding method as the compiled loop runs it: the one contract every jitted decoder implements.

  Attributes:
    name: what `driver.compile_count` counts its loop's compilations under.
    start_rows: the idle rows and width counters of a batch (`StartRows`).
    admit: a prompt into an idle row (`Admit`).
    step: one iteration of every row (`Step`).
    width_names: the names of the width counters' rows ("forward" first).
  """

  name: str
  start_rows: StartRows[SettingsT, RowsT]
  admit: Admit[KnobsT, SettingsT, RowsT]
  step: Step[KnobsT, SettingsT, RowsT]
  width_names: tuple[str, ...] = ("forward",)
