"""A decoding method the package does not ship, written as a newcomer would: one file, nothing edited elsewhere.

`Strided` decodes autoregressively `stride` tokens per loop iteration: each
iteration runs `stride` one-token forwards back to back inside the compiled
loop, so its tokens are AR's, token for token (greedy or sampled: its noise is
drawn per answer offset, as AR's), while the host sees one loop iteration per
`stride` tokens and its answers grow `stride` tokens at a time. Registering the
class (`register_method`) is all it takes for the command lines, the
evaluation, the lm-eval harness and the server to know it by name
(tests/test_new_method.py runs it through each).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from refusion_jax.data.special_tokens import SpecialTokens
from refusion_jax.decoding.batching import count_width, host_zeros, put_row
from refusion_jax.decoding.checks import check_count, check_temperature, optional_eos_id
from refusion_jax.decoding.contract import DecodeOutputs, Decoder, MethodFacts, Sampling
from refusion_jax.decoding.methods import register_method
from refusion_jax.decoding.prompts import prefill
from refusion_jax.decoding.result import PHASE_STEP
from refusion_jax.decoding.scoring import pick_tokens
from refusion_jax.model import cache as kv_cache
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class StridedSettings:
  """What fixes the compiled program: the answer length G, the tokens per iteration, whether to sample."""

  gen_length: int
  stride: int
  sample: bool


@flax.struct.dataclass
class StridedKnobs:
  eos_id: jax.Array


@flax.struct.dataclass
class _Rows:
  """Per-row state (K rows): the KV cache, [K] prompt lengths, [K] last tokens, [K] answer lengths, [K] done."""

  cache: kv_cache.KVCache
  prompt_length: jax.Array
  token: jax.Array
  length: jax.Array
  done: jax.Array


def _write(out: DecodeOutputs, entry: jax.Array, offset: jax.Array, token: jax.Array, iteration: jax.Array):
  """Token [K] at answer `offset` [K] of queue entries `entry` [K] (Q: dropped), committed at `iteration` [K]."""
  return out.replace(
    answer=out.answer.at[entry, offset].set(token, mode="drop"),
    commit_iteration=out.commit_iteration.at[entry, offset].set(iteration, mode="drop"),
    commit_phase=out.commit_phase.at[entry, offset].set(PHASE_STEP, mode="drop"),
    num_forwards=out.num_forwards.at[entry].add(1, mode="drop"),
  )


def _admit(model: Transformer, knobs, settings, rows, out, row, entry, sampling: Sampling, tokens, length):
  """The prompt's prefill yields its first token (iteration 0)."""
  logits, one = prefill(model, tokens[None], length[None], rows.cache.capacity)
  last = jax.lax.dynamic_slice_in_dim(logits, length - 1, 1, axis=1)
  zero = jnp.zeros((1,), jnp.int32)
  first = pick_tokens(last, sampling.key[None], jax.tree.map(lambda x: x[None], sampling.rule), zero, settings.sample)[
    0
  ][:, 0]
  done = (first == knobs.eos_id) | (settings.gen_length == 1)
  rows = put_row(rows, row, _Rows(one, length[None], first, jnp.ones((1,), jnp.int32), done))
  out = _write(out, entry[None], zero, first, zero)
  return rows, out.replace(steps=out.steps.at[entry].add(1))


def _step(model: Transformer, knobs, settings, rows, out, widths, live, entry, sampling: Sampling):
  """`stride` one-token forwards of every unfinished row, one loop iteration."""
  queue = out.steps.shape[0]
  iteration = out.steps.at[entry].get(mode="fill", fill_value=0)

  def one_token(_, carry):
    rows, out, widths = carry
    working = live & ~rows.done
    positions = (rows.prompt_length + rows.length - 1)[:, None]
    mask = kv_cache.block_mask(rows.cache, jnp.ones((live.shape[0], 1, 1), bool))
    logits, kv = model(rows.token[:, None], positions, mask, rows.cache)
    cache = kv_cache.append(rows.cache, kv, positions, working[:, None])
    token = pick_tokens(logits, sampling.key, sampling.rule, rows.length, settings.sample)[0][:, 0]
    out = _write(out, jnp.where(working, entry, queue), rows.length, token, iteration)
    ended = working & ((token == knobs.eos_id) | (rows.length + 1 >= settings.gen_length))
    widths = count_width(widths, 1, jnp.any(working)[None])
    rows = rows.replace(
      cache=cache, token=jnp.where(working, token, rows.token), length=rows.length + working, done=rows.done | ended
    )
    return rows, out, widths

  rows, out, widths = jax.lax.fori_loop(0, settings.stride, one_token, (rows, out, widths))
  out = out.replace(steps=out.steps.at[jnp.where(live, entry, queue)].add(1, mode="drop"))
  return rows, out, widths, live & rows.done


def _empty_rows(config: ModelConfig, rows: int, capacity: int) -> _Rows:
  zeros = jnp.zeros((rows,), jnp.int32)
  return _Rows(kv_cache.KVCache.create(config, rows, capacity), zeros, zeros, zeros, jnp.zeros((rows,), bool))


def start_rows(settings: StridedSettings, config: ModelConfig, rows: int, prompt_width: int):
  """Idle rows and a zero count of the width-1 forwards."""
  return host_zeros(_empty_rows, config, rows, prompt_width + settings.gen_length), np.zeros((1, 2), np.int32)


@register_method
@dataclasses.dataclass(frozen=True)
class Strided(MethodFacts):
  """Autoregressive decoding, `stride` tokens per loop iteration: `rj.decode(model, ids, Strided(stride=2))`.

  Attributes:
    gen_length: G, a multiple of stride.
    stride: tokens (one-token forwards) per loop iteration.
    temperature: 0 for greedy, else Gumbel-max sampling at that temperature.
  """

  name: ClassVar[str] = "strided"
  width_names: ClassVar[tuple[str, ...]] = ("forward",)
  start_rows: ClassVar = staticmethod(start_rows)
  admit: ClassVar = staticmethod(_admit)
  step: ClassVar = staticmethod(_step)

  gen_length: int = 16
  stride: int = 2
  temperature: float = 0.0

  def __post_init__(self) -> None:
    check_count("gen_length", self.gen_length, 16)
    check_count("stride", self.stride, 2)
    if self.gen_length % self.stride:
      raise ValueError(f"gen_length={self.gen_length} must be a multiple of stride={self.stride}.")
    check_temperature(self.temperature)

  @property
  def label(self) -> str:
    return f"strided k{self.stride}"

  @property
  def answer_grid(self) -> int:
    return self.stride

  @property
  def token_grid(self) -> int:
    return self.stride

  def decoder(self, config: ModelConfig, special: SpecialTokens, *, pick_rows: bool, sample: bool) -> Decoder:
    del pick_rows
    eos = optional_eos_id(special.eos, config)
    settings = StridedSettings(self.gen_length, self.stride, sample)
    return Decoder(self, settings, StridedKnobs(eos_id=np.int32(eos)), eos)
