"""The autoregressive baseline: plain next-token decoding with the KV cache, on ReFusion's backbone.

One prompt prefill yields the first token, then one forward per further
token. The `AR` value (its class a `contract.Method`): batched and jitted end
to end as one `lax.while_loop` over a `refusion_jax.decoding.batching.LoopState`
(so `batch_size` gives continuous batching), run by
`refusion_jax.decoding.engine.decode`, whose `DecodeResult` records
`PHASE_STEP` for every token.
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
from refusion_jax.decoding.prompts import prefill
from refusion_jax.decoding.result import PHASE_STEP
from refusion_jax.decoding.scoring import pick_tokens
from refusion_jax.model import cache as kv_cache
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class ARSettings:
  """What fixes the compiled program (a static, hashable jit argument): the answer length G, whether to sample."""

  gen_length: int
  sample: bool


@flax.struct.dataclass
class ARKnobs:
  """Scalars that change nothing in the compiled program (traced): the stop id."""

  eos_id: jax.Array


@flax.struct.dataclass
class _RowState:
  """Per-row state (K rows).

  cache:         KV cache of prompt + answer, capacity = prompt bucket + G
  prompt_length: [K] int32
  token:         [K] int32 the last token, fed by the next forward
  done:          [K] bool the row has its answer (EOS or G tokens)
  """

  cache: kv_cache.KVCache
  prompt_length: jax.Array
  token: jax.Array
  done: jax.Array


def _record(
  out: DecodeOutputs, entry: jax.Array, step: jax.Array, token: jax.Array, logprob: jax.Array
) -> DecodeOutputs:
  """Write `token` [K] (and its log-probability) at answer offset `step` [K] of queue entries `entry` [K] (Q:
  none) as one more step and forward."""
  return out.replace(
    answer=out.answer.at[entry, step].set(token, mode="drop"),
    logprob=out.logprob.at[entry, step].set(logprob, mode="drop"),
    commit_iteration=out.commit_iteration.at[entry, step].set(step, mode="drop"),
    commit_phase=out.commit_phase.at[entry, step].set(PHASE_STEP, mode="drop"),
    num_forwards=out.num_forwards.at[entry].add(1, mode="drop"),
    steps=out.steps.at[entry].add(1, mode="drop"),
  )


def _admit(
  model: Transformer,
  knobs: ARKnobs,
  settings: ARSettings,
  state: _RowState,
  out: DecodeOutputs,
  row: jax.Array,
  entry: jax.Array,
  sampling: Sampling,
  tokens: jax.Array,
  length: jax.Array,
) -> tuple[_RowState, DecodeOutputs]:
  """Prefill the prompt of `entry` into row `row`; the prefill yields the first token (a `contract.Admit`)."""
  logits, one = prefill(model, tokens[None], length[None], state.cache.capacity)
  last = jax.lax.dynamic_slice_in_dim(logits, length - 1, 1, axis=1)
  rule = jax.tree.map(lambda x: x[None], sampling.rule)
  first, _, logprob = pick_tokens(last, sampling.key[None], rule, jnp.zeros((1,), jnp.int32), settings.sample)
  first = first[:, 0]
  done = (first == knobs.eos_id) | (settings.gen_length == 1)
  state = put_row(state, row, _RowState(cache=one, prompt_length=length[None], token=first, done=done))
  return state, _record(out, entry[None], jnp.zeros((1,), jnp.int32), first, logprob[:, 0])


def _step(
  model: Transformer,
  knobs: ARKnobs,
  settings: ARSettings,
  state: _RowState,
  out: DecodeOutputs,
  widths: jax.Array,
  live: jax.Array,
  entry: jax.Array,
  sampling: Sampling,
) -> tuple[_RowState, DecodeOutputs, jax.Array, jax.Array]:
  """Feed each unfinished row its last token (a `contract.Step`); a row with its answer finishes without one."""
  working = live & ~state.done
  step = out.steps.at[entry].get(mode="fill", fill_value=0)  # answer tokens so far
  positions = (state.prompt_length + step - 1)[:, None]
  mask = kv_cache.block_mask(state.cache, jnp.ones((live.shape[0], 1, 1), bool))
  logits, kv = model(state.token[:, None], positions, mask, state.cache)
  cache = kv_cache.append(state.cache, kv, positions, working[:, None])
  token, _, logprob = pick_tokens(logits, sampling.key, sampling.rule, step, settings.sample)
  token = token[:, 0]
  out = _record(out, jnp.where(working, entry, out.steps.shape[0]), step, token, logprob[:, 0])
  done = state.done | (working & ((token == knobs.eos_id) | (step + 1 >= settings.gen_length)))
  widths = count_width(widths, 1, jnp.any(working)[None])
  return state.replace(cache=cache, token=jnp.where(working, token, state.token), done=done), out, widths, live & done


def _rows(config: ModelConfig, rows: int, capacity: int) -> _RowState:
  zeros = jnp.zeros((rows,), jnp.int32)
  cache = kv_cache.KVCache.create(config, rows, capacity)
  return _RowState(cache=cache, prompt_length=zeros, token=zeros, done=jnp.zeros((rows,), bool))


def start_rows(settings: ARSettings, config: ModelConfig, rows: int, prompt_width: int) -> tuple[_RowState, np.ndarray]:
  """Idle rows and a zero count of the width-1 forwards (a `contract.StartRows`)."""
  return host_zeros(_rows, config, rows, prompt_width + settings.gen_length), np.zeros((1, 2), np.int32)


@dataclasses.dataclass(frozen=True)
class AR(MethodFacts):
  """The autoregressive baseline as a typed, hashable value: `rj.decode(model, ids, AR(gen_length=64))`.

  The prompt prefill is one forward and yields the first token; each further token costs one forward of the
  previous token. A row stops at its first EOS (the call's, else the config's; none if both are unset) or
  after G tokens. Its `DecodeResult`: num_forwards = steps = answer tokens per prompt (prefill included),
  commit_iteration[b, t] = t.

  Attributes:
    gen_length: G, the most tokens to generate per prompt.
    temperature: 0 for greedy, else Gumbel-max sampling at that temperature.
  """

  name: ClassVar[str] = "ar"
  width_names: ClassVar[tuple[str, ...]] = ("forward",)
  start_rows: ClassVar = staticmethod(start_rows)
  admit: ClassVar = staticmethod(_admit)
  step: ClassVar = staticmethod(_step)

  gen_length: int = 64
  temperature: float = 0.0

  def __post_init__(self) -> None:
    check_count("gen_length", self.gen_length, 64)
    check_temperature(self.temperature)

  def decoder(self, config: ModelConfig, special: SpecialTokens, *, pick_rows: bool, sample: bool) -> Decoder:
    """The settings and knobs of one decode call (a `contract.Method`); every row is in every forward."""
    del pick_rows
    eos = optional_eos_id(special.eos, config)
    return Decoder(self, ARSettings(self.gen_length, sample=sample), ARKnobs(eos_id=np.int32(eos)), eos)
