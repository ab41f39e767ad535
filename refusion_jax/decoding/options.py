"""How a decode runs, whatever the method: one typed value (`DecodeOptions`) that every decoding front door takes.

A method value (`rj.ReFusion(...)`) says *what* to decode; `DecodeOptions`
says *how* the calls run it: how many rows the compiled loop keeps busy, the
sampling seed, the special ids, the device mesh, how many iterations a loop
call may run, how many prompt tokens a prefix cache keeps. `rj.decode`,
`rj.Sampler`, `rj.Engine`, the evaluation's runner and the server take it
whole, and their keyword shorthands (`rj.decode(..., rows=8)`) are its
fields; `cli.add_decode_flags` spells the same fields as flags of every
command.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax

from refusion_jax.data.special_tokens import resolve_special_tokens
from refusion_jax.data.tokenizer import Tokenizer
from refusion_jax.decoding.checks import check_positive
from refusion_jax.decoding.prefix_cache import PREFIX_BLOCK_TOKENS
from refusion_jax.deprecation import warn_deprecated
from refusion_jax.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
  """How decode calls run (docs/sampling.md, "Decode options").

  Attributes:
    rows: K, the rows the compiled loop keeps busy (continuous batching: a finished row takes the next prompt);
      None: every prompt of a call at once (K = its prompt count).
    seed: the PRNG seed of sampling (temperature > 0): prompt i of a call draws from fold_in(key(seed), i),
      whatever the rows.
    mask_id, eos_id, pad_id: the special ids; None: the tokenizer's (`Sampler`), else the model config's.
      ReFusion needs a mask and an EOS id, MDM a mask id; pad_id falls back to the EOS, then 0 (never attended).
    mesh: decode on this mesh (`rj.make_mesh`): rows split over its batch-parallel axes (their count padded to
      a multiple of its batch-parallel devices), parameters and cache by their logical axes; None: the default
      device.
    chunk_iterations: a loop call runs at most this many iterations (state in, state out, as a server drives
      it), with the same results; None: each call runs until the queue needs the host.
    logprobs: return each answer token's log-probability (`DecodeResult.logprobs`) and the whole committed
      trajectory (`DecodeResult.rollout`); the loop records them either way, so nothing compiles again.
    prefix_cache_tokens: keep the KV of this many prompt tokens (in blocks of 16, least recently used evicted)
      for later prompts that begin with the same tokens, which then prefill only the rest, with the same
      answers (`prefix_cache.PrefixCache`; a `Sampler` keeps it across calls); 0: off.
  """

  rows: int | None = None
  seed: int = 0
  mask_id: int | None = None
  eos_id: int | None = None
  pad_id: int | None = None
  mesh: jax.sharding.Mesh | None = None
  chunk_iterations: int | None = None
  logprobs: bool = False
  prefix_cache_tokens: int = 0

  def __post_init__(self) -> None:
    check_positive("rows", self.rows, "every prompt of a call at once")
    check_positive("chunk_iterations", self.chunk_iterations, "run the loop until the host must refill it")
    if not isinstance(self.logprobs, bool):
      raise ValueError(f"logprobs={self.logprobs!r} must be True or False.")
    tokens = self.prefix_cache_tokens
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not (tokens == 0 or tokens >= PREFIX_BLOCK_TOKENS):
      raise ValueError(
        f"prefix_cache_tokens={tokens!r} must be 0 (off) or at least {PREFIX_BLOCK_TOKENS} tokens, e.g. 4096."
      )
    if isinstance(self.seed, bool) or not isinstance(self.seed, int):
      raise ValueError(f"seed={self.seed!r} must be an integer.")
    for name in ("mask_id", "eos_id", "pad_id"):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{name}={value!r} must be a token id (an integer) or None.")

  def with_tokenizer_ids(self, tokenizer: Tokenizer, config: ModelConfig) -> DecodeOptions:
    """These options with the special ids left unset taken from `tokenizer` (the ids the model was trained
    with), else from `config` (`resolve_special_tokens`): what `Sampler` and the server decode with."""
    known = resolve_special_tokens(tokenizer=tokenizer, config=config)
    return dataclasses.replace(
      self,
      mask_id=known.mask if self.mask_id is None else self.mask_id,
      eos_id=known.eos if self.eos_id is None else self.eos_id,
      pad_id=known.pad if self.pad_id is None else self.pad_id,
    )

  @property
  def special_ids(self) -> dict[str, int | None]:
    """The special ids as keywords: {"mask_id": ..., "eos_id": ..., "pad_id": ...}."""
    return dict(mask_id=self.mask_id, eos_id=self.eos_id, pad_id=self.pad_id)


OPTION_NAMES = tuple(field.name for field in dataclasses.fields(DecodeOptions))


def decode_options(options: DecodeOptions | None, given: Mapping[str, Any], caller: str) -> DecodeOptions:
  """`options` (None: the defaults) with the keyword shorthands `given` replacing its fields.

  `batch_size` is read as `rows`, with a `DeprecationWarning` (its 0.2 name).

  Raises:
    TypeError: a keyword that is no option, named with the options there are.
  """
  given = dict(given)
  if "batch_size" in given:
    warn_deprecated(f"{caller}(..., batch_size=K)", f"{caller}(..., rows=K)", stacklevel=4)
    if given.get("rows") is not None:
      raise TypeError(f"{caller}: give rows= only (batch_size= is its old name).")
    given["rows"] = given.pop("batch_size")
  unknown = sorted(set(given) - set(OPTION_NAMES))
  if unknown:
    raise TypeError(
      f"{caller} got unexpected keyword(s) {', '.join(unknown)}; its decode options are: {', '.join(OPTION_NAMES)}."
    )
  options = DecodeOptions() if options is None else options
  if not isinstance(options, DecodeOptions):
    raise TypeError(f"{caller}: options={options!r} is not a refusion_jax.DecodeOptions.")
  return dataclasses.replace(options, **given) if given else options
