"""The decoder contract: what a decoding method hands the one compiled loop (docs/architecture.md §4).

A decoding method is a typed value (`refusion.ReFusion`, `ar.AR`, `mdm.MDM`):
a frozen dataclass of the user's choices, checked when it is built, whose
class is a `Method`: how to split itself into a `Decoder` (static settings
and traced knobs), how to start K idle rows, how to admit a queued prompt
into one idle row, and how to step every row. The loop
(`batching.run_rows`, jitted as `loop.decode_loop`) does the rest: which
row takes which prompt, when to hand back to the host, where the outputs go
(`DecodeOutputs`). Each method names its parts alike: `XSettings` (static,
hashable: what fixes the compiled program), `XKnobs` (traced: thresholds,
ids), `start_rows`, `admit`, `step`; each prompt's `Sampling` (noise key,
temperature) rides in the loop's queue beside it.

Shapes: K rows, Q queue entries (`batching.queue_entries(K)`), P the prompt
bucket, G the answer length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any, ClassVar, Protocol, TypeVar

import flax.struct
import jax
import numpy as np

from refusion_jax.data.special_tokens import SpecialTokens
from refusion_jax.decoding.result import PHASE_NONE, DecodeResult
from refusion_jax.decoding.scoring import SamplingRule
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer


@flax.struct.dataclass
class DecodeOutputs:
  """What a decode loop writes, per queue entry (Q of them): what `Admit` and `Step` write.

  answer:           [Q, G] int32 ids by answer offset (anything where none was committed)
  commit_iteration: [Q, G] int32 iteration (0-based) that committed each offset, -1 where none
  commit_phase:     [Q, G] int32 PHASE_* of each offset, PHASE_NONE where none
  logprob:          [Q, G] float32 log-probability of each offset's token under the distribution it was drawn from
                    (`scoring.policy_logprobs`), NaN where none
  num_forwards:     [Q] int32 forwards the prompt's row took part in (its prefill included)
  steps:            [Q] int32 decode iterations of the prompt
  """

  answer: jax.Array
  commit_iteration: jax.Array
  commit_phase: jax.Array
  logprob: jax.Array
  num_forwards: jax.Array
  steps: jax.Array

  @classmethod
  def empty(cls, entries: int, gen_length: int) -> DecodeOutputs:
    """Nothing committed yet, as host arrays (starting a batch dispatches no device work), one per field."""
    none = lambda: np.full((entries, gen_length), -1, np.int32)
    zeros = lambda: np.zeros((entries,), np.int32)
    phase = np.full((entries, gen_length), PHASE_NONE, np.int32)
    return cls(none(), none(), phase, np.full((entries, gen_length), np.nan, np.float32), zeros(), zeros())


class Settings(Hashable, Protocol):
  """A method's static settings: a frozen dataclass (a static jit argument), with the answer length and whether
  the program draws sampling noise."""

  @property
  def gen_length(self) -> int: ...

  @property
  def sample(self) -> bool: ...


@flax.struct.dataclass
class Sampling:
  """How prompts sample (traced), per queue entry of the loop state: [] in `Admit`, each row's [K] in `Step`.

  key:         typed PRNG key: fold_in(key(seed), the prompt's index); its step s draws from fold_in(key, s)
  temperature: float32 Gumbel-max temperature; 0 adds no noise: greedy, bit for bit, where the program samples
  top_k, top_p, min_p: the filters of what the prompt draws from (`scoring.SamplingRule`; 0, 1, 0: off)
  """

  key: jax.Array
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  min_p: jax.Array

  @property
  def rule(self) -> SamplingRule:
    """What the prompt draws from, without its noise key."""
    return SamplingRule(self.temperature, self.top_k, self.top_p, self.min_p)


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
    sampling: Sampling,
    tokens: jax.Array,
    length: jax.Array,
  ) -> tuple[RowsT, DecodeOutputs]:
    """Start a queued prompt in an idle row (traced inside the loop).

    Args:
      row: [] int32 the idle row that takes the prompt.
      entry: [] int32 the prompt's queue entry: its outputs go to `out` there.
      sampling: the prompt's `Sampling` (scalars).
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
    sampling: Sampling,
  ) -> tuple[RowsT, DecodeOutputs, jax.Array, jax.Array]:
    """One decode iteration of every row (traced inside the loop).

    Args:
      widths: [len(width_names), largest width + 1] int32 forwards counted by query width.
      live: [K] bool the rows decoding a prompt.
      entry: [K] int32 each row's queue entry, Q on idle rows (so their writes to `out` drop).
      sampling: each row's prompt's `Sampling` ([K]; anything on idle rows).

    Returns:
      (rows, out, widths with this iteration's forwards counted, finished [K] bool: live rows whose
      answer is done, which turn idle).
    """
    ...


@dataclasses.dataclass(frozen=True)
class Decoder:
  """A method value split for one decode call (`Method.decoder`): what the compiled loop runs.

  Attributes:
    method: the method value (its class is the `Method` the loop runs).
    settings: what fixes the compiled program (static and hashable; has `gen_length`, G).
    knobs: the traced knobs (a pytree of arrays: thresholds, ids).
    eos_id: the checked stop id answers are cut after (`checks.NO_TOKEN`: none).
  """

  method: Method
  settings: Settings
  knobs: Any
  eos_id: int


class Method(Protocol):
  """A decoding method: a frozen, hashable dataclass of the user's choices whose class runs in the compiled loop.

  The class attributes are what the loop needs, static: its `name` (what `loop.compile_count` counts its
  compilations under, and what command lines call it), `width_names` (the width counters' rows, "forward"
  first) and the three traced parts `start_rows`, `admit`, `step` (static methods). The instance holds the
  user's choices (`gen_length`, G, `temperature`, the requests' unless they bring their own, and the method's
  own) and `decoder` splits them, once per decode call, into the loop's static settings and traced knobs:
  checks that need the model (special ids inside the vocabulary) happen there. `special` holds the call's mask
  and EOS ids as given or resolved (None where unknown); `pick_rows` whether a forward may run a subset of the
  rows (the engine's decision: not where rows are split over devices; methods that never pick rows ignore it)
  and `sample` whether the program draws sampling noise (the engine's decision: the method's temperature is
  above 0, or requests bring their own temperatures). Each prompt's noise key and temperature are in the loop's
  queue (`Sampling`), not the knobs.

  What the rest of the package asks of a method besides the loop's parts (the evaluation's labels, the
  harness's answer lengths and statistics, the server's token limits) is asked of the value too, so that a new
  method needs no edit outside its own file; `MethodFacts` gives the defaults a method may inherit:
  `label`, `answer_grid`, `token_grid`, `resized` and `official_tpf`.
  """

  name: ClassVar[str]
  width_names: ClassVar[tuple[str, ...]]
  start_rows: ClassVar[StartRows]
  admit: ClassVar[Admit]
  step: ClassVar[Step]

  @property
  def gen_length(self) -> int: ...

  @property
  def temperature(self) -> float: ...

  @property
  def label(self) -> str: ...

  @property
  def answer_grid(self) -> int: ...

  @property
  def token_grid(self) -> int: ...

  def resized(self, gen_length: int) -> Method: ...

  def official_tpf(self, result: DecodeResult, row: int) -> float: ...

  def decoder(self, config: ModelConfig, special: SpecialTokens, *, pick_rows: bool, sample: bool) -> Decoder: ...


class MethodFacts:
  """The facts a `Method` states about itself beyond the loop's parts, with the defaults of a method that commits
  one token at a time and has no settings tied to the answer length; a method class inherits it and overrides
  what differs (`refusion.ReFusion` overrides all of them).
  """

  @property
  def label(self) -> str:
    """A short name for reports and plots, e.g. "refusion S8 0.9/0.5"; the class's `name` by default."""
    return self.name  # type: ignore[attr-defined]

  @property
  def answer_grid(self) -> int:
    """The multiple every answer length G must be (ReFusion: S x NB): where a request asks for fewer tokens than
    G (lm-eval's `max_gen_toks`), its G is rounded up to it."""
    return 1

  @property
  def token_grid(self) -> int:
    """The fewest tokens an answer grows by where it grows (ReFusion: a slot): a token limit is rounded up to it,
    since what is committed together is never cut apart."""
    return 1

  def resized(self, gen_length: int) -> Method:
    """This method for answers of `gen_length` tokens: what follows the answer length follows it (MDM's block
    and steps are cut to it, ReFusion's serial blocks fitted), every other field kept. The harness decodes each
    request at its own G this way, a sweep moves a config's settings to the command line's G, and a paper task
    takes a shorter answer."""
    return dataclasses.replace(self, gen_length=gen_length)  # type: ignore[type-var]

  def official_tpf(self, result: DecodeResult, row: int) -> float:
    """Tokens per forward of answer `row` of `result` as the method's official evaluation counts them (ReFusion:
    per plan-and-infill cycle); NaN where it has no such count (ours, `DecodeResult.tpf`, is always there)."""
    del result, row
    return float("nan")
