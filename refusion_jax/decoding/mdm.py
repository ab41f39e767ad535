"""The masked-diffusion baseline: LLaDA-style decoding with low-confidence remasking, on ReFusion's backbone.

No cache: every step is one bidirectional forward over prompt + answer. The
answer is decoded in semi-autoregressive blocks, and per step the most
confident masked tokens up to the current block's end are unmasked (LLaDA's
`generate.py`). The `MDM` value (its class a `contract.Method`): batched and
jitted end to end as one `lax.while_loop` over a
`refusion_jax.decoding.batching.LoopState` (so `batch_size` gives continuous
batching), run by `refusion_jax.decoding.engine.decode`, whose `DecodeResult` records
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
from refusion_jax.decoding.batching import count_width, put_row
from refusion_jax.decoding.checks import check_count, check_special_id, check_temperature, optional_eos_id
from refusion_jax.decoding.contract import DecodeOutputs, Decoder, MethodFacts, Sampling
from refusion_jax.decoding.result import PHASE_NONE, PHASE_STEP
from refusion_jax.decoding.scoring import pick_tokens
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer

# MDM's blocks: this many tokens, or the whole answer when it is shorter (LLaDA's usual setting).
MDM_BLOCK_LENGTH = 32


def num_transfer_tokens(block_length: int, steps_per_block: int) -> np.ndarray:
  """LLaDA's `get_num_transfer_tokens` for a fully masked block.

  Returns:
    [steps_per_block] tokens to unmask per step: an even split, with the
    remainder going to the first steps.
  """
  base, remainder = divmod(block_length, steps_per_block)
  counts = np.full(steps_per_block, base, np.int32)
  counts[:remainder] += 1
  return counts


def check_mdm_schedule(gen_length: int, block_length: int, steps: int) -> int:
  """Validate the block/step split; returns steps per block."""
  if block_length < 1 or gen_length % block_length:
    raise ValueError(
      f"gen_length={gen_length} must be a positive multiple of block_length={block_length}; "
      f"pick block_length among the divisors of gen_length."
    )
  num_blocks = gen_length // block_length
  if steps < 1 or steps % num_blocks:
    raise ValueError(
      f"steps={steps} must be a positive multiple of the number of blocks "
      f"(gen_length / block_length = {num_blocks}), so every block gets the same number of steps."
    )
  steps_per_block = steps // num_blocks
  if steps_per_block > block_length:
    raise ValueError(
      f"steps={steps} gives {steps_per_block} steps per block but a block has only "
      f"{block_length} tokens; use at most steps={block_length * num_blocks}."
    )
  return steps_per_block


@dataclasses.dataclass(frozen=True)
class MDMSettings:
  """What fixes the compiled program (a static, hashable jit argument): the block/step split and sampling."""

  gen_length: int
  block_length: int
  steps: int
  sample: bool

  @property
  def steps_per_block(self) -> int:
    return self.steps // (self.gen_length // self.block_length)


@flax.struct.dataclass
class MDMKnobs:
  """Scalars that change nothing in the compiled program (traced): the mask id."""

  mask_id: jax.Array


@flax.struct.dataclass
class _RowState:
  """Per-row state (K rows, P = prompt bucket).

  prompt:        [K, P] int32 right-padded prompt
  prompt_length: [K] int32
  answer:        [K, G] int32 the answer so far, mask ids where still masked
  committed_at:  [K, G] int32 step that unmasked each offset, -1 where none
  logprob:       [K, G] float32 each unmasked token's log-probability at the step that unmasked it, NaN where none
  """

  prompt: jax.Array
  prompt_length: jax.Array
  answer: jax.Array
  committed_at: jax.Array
  logprob: jax.Array


def _admit(
  model: Transformer,
  knobs: MDMKnobs,
  settings: MDMSettings,
  state: _RowState,
  out: DecodeOutputs,
  row: jax.Array,
  entry: jax.Array,
  sampling: Sampling,
  tokens: jax.Array,
  length: jax.Array,
) -> tuple[_RowState, DecodeOutputs]:
  """Put the prompt of `entry` into row `row` with a fully masked answer (a `contract.Admit`; no forward)."""
  del model, entry, sampling  # no prefill: the first step reads the prompt
  G = settings.gen_length
  fresh = _RowState(
    prompt=tokens[None],
    prompt_length=length[None],
    answer=jnp.full((1, G), knobs.mask_id, jnp.int32),
    committed_at=jnp.full((1, G), -1, jnp.int32),
    logprob=jnp.full((1, G), jnp.nan, jnp.float32),
  )
  return put_row(state, row, fresh), out


def _step(
  model: Transformer,
  knobs: MDMKnobs,
  settings: MDMSettings,
  state: _RowState,
  out: DecodeOutputs,
  widths: jax.Array,
  live: jax.Array,
  entry: jax.Array,
  sampling: Sampling,
) -> tuple[_RowState, DecodeOutputs, jax.Array, jax.Array]:
  """One unmasking step of every row: a bidirectional forward over [prompt bucket | answer] (a `contract.Step`).

  The prompt keeps its right padding and the answer follows the bucket, but
  every token carries its true position (answer j sits at length + j) and no
  query sees padding, so with bidirectional attention this equals LLaDA's
  contiguous layout.
  """
  batch, width = state.prompt.shape
  G, per_block = settings.gen_length, settings.steps_per_block
  transfer_counts = jnp.asarray(num_transfer_tokens(settings.block_length, per_block))
  step = out.steps.at[entry].get(mode="fill", fill_value=0)

  columns = jnp.arange(width)[None, :]
  positions = jnp.concatenate(
    [jnp.broadcast_to(columns, (batch, width)), state.prompt_length[:, None] + jnp.arange(G)], 1
  )
  key_valid = jnp.concatenate([columns < state.prompt_length[:, None], jnp.ones((batch, G), bool)], 1)
  mask = jnp.broadcast_to(key_valid[:, None, :], (batch, width + G, width + G))
  logits, _ = model(jnp.concatenate([state.prompt, state.answer], 1), positions, mask)
  draft, confidence, draft_logprob = pick_tokens(logits[:, width:], sampling.key, sampling.rule, step, settings.sample)
  block_of = jnp.arange(G) // settings.block_length
  # Masked positions up to the current block's end, as LLaDA's generate.py: a position of an earlier block is
  # masked still only where the model drafted the mask id itself, and LLaDA drafts it again.
  candidate = (state.answer == knobs.mask_id) & (block_of[None, :] <= (step // per_block)[:, None])
  confidence = jnp.where(candidate, confidence, -jnp.inf)
  # Rank by confidence (stable: ties go to the earlier position) and take the top k.
  order = jnp.argsort(-confidence, axis=-1, stable=True)
  rank = jnp.argsort(order, axis=-1)
  transfer = candidate & (rank < transfer_counts[step % per_block][:, None]) & live[:, None]
  answer = jnp.where(transfer, draft, state.answer)
  committed_at = jnp.where(transfer, step[:, None], state.committed_at)
  logprob = jnp.where(transfer, draft_logprob, state.logprob)

  out = out.replace(
    answer=out.answer.at[entry].set(answer, mode="drop"),
    commit_iteration=out.commit_iteration.at[entry].set(committed_at, mode="drop"),
    logprob=out.logprob.at[entry].set(logprob, mode="drop"),
    commit_phase=out.commit_phase.at[entry].set(jnp.where(committed_at >= 0, PHASE_STEP, PHASE_NONE), mode="drop"),
    num_forwards=out.num_forwards.at[entry].add(1, mode="drop"),
    steps=out.steps.at[entry].add(1, mode="drop"),
  )
  widths = count_width(widths, width + G, jnp.ones((1,), jnp.int32))
  state = state.replace(answer=answer, committed_at=committed_at, logprob=logprob)
  return state, out, widths, live & (step + 1 >= settings.steps)


def start_rows(
  settings: MDMSettings, config: ModelConfig, rows: int, prompt_width: int
) -> tuple[_RowState, np.ndarray]:
  """Idle rows and a zero count of the [prompt | answer]-wide forwards (a `contract.StartRows`)."""
  del config  # no cache
  G = settings.gen_length
  state = _RowState(
    prompt=np.zeros((rows, prompt_width), np.int32),
    prompt_length=np.zeros((rows,), np.int32),
    answer=np.zeros((rows, G), np.int32),
    committed_at=np.zeros((rows, G), np.int32),
    logprob=np.zeros((rows, G), np.float32),
  )
  return state, np.zeros((1, prompt_width + G + 1), np.int32)


@dataclasses.dataclass(frozen=True)
class MDM(MethodFacts):
  """The masked-diffusion baseline (LLaDA-style low-confidence remasking) as a typed, hashable value:
  `rj.decode(model, ids, MDM(gen_length=64))`.

  The answer starts as G mask tokens, split into G / block_length blocks decoded left to right with steps /
  num_blocks steps each. Each step is one bidirectional forward over prompt + answer; of the masked positions up
  to the current block's end (earlier blocks hold masks only where the model drafted the mask id), the
  `num_transfer_tokens` most confident predictions are unmasked. Every row runs all
  `steps` forwards (as LLaDA does); the answer is cut after its first EOS. commit_iteration is the step that
  unmasked each position.

  Attributes:
    gen_length: G, a multiple of block_length.
    block_length: tokens per semi-autoregressive block; None: min(32, G) (LLaDA's usual setting).
    steps: total forwards, a multiple of the number of blocks and at most G; None: G (one token per step).
    temperature: 0 for greedy drafts, else Gumbel-max sampled drafts.
  """

  name: ClassVar[str] = "mdm"
  width_names: ClassVar[tuple[str, ...]] = ("forward",)
  start_rows: ClassVar = staticmethod(start_rows)
  admit: ClassVar = staticmethod(_admit)
  step: ClassVar = staticmethod(_step)

  gen_length: int = 64
  block_length: int | None = None
  steps: int | None = None
  temperature: float = 0.0

  def __post_init__(self) -> None:
    check_count("gen_length", self.gen_length, 64)
    # Unset, the block and the steps follow G: the value says what it runs (and compares equal to it spelt out).
    if self.block_length is None:
      object.__setattr__(self, "block_length", min(MDM_BLOCK_LENGTH, self.gen_length))
    if self.steps is None:
      object.__setattr__(self, "steps", self.gen_length)
    check_count("block_length", self.block_length, min(MDM_BLOCK_LENGTH, self.gen_length))
    check_count("steps", self.steps, self.gen_length)
    check_mdm_schedule(self.gen_length, self.block_length, self.steps)
    check_temperature(self.temperature)

  @property
  def label(self) -> str:
    return f"mdm B{self.block_length} {self.steps} steps"

  @property
  def answer_grid(self) -> int:
    return self.block_length  # G splits into whole blocks

  def resized(self, gen_length: int) -> MDM:
    """MDM for G = `gen_length`: the block and the steps cut to G where they exceed it."""
    return dataclasses.replace(
      self, gen_length=gen_length, block_length=min(self.block_length, gen_length), steps=min(self.steps, gen_length)
    )

  def decoder(self, config: ModelConfig, special: SpecialTokens, *, pick_rows: bool, sample: bool) -> Decoder:
    """The settings and knobs of one decode call (a `contract.Method`); the mask id must be known."""
    del pick_rows
    mask = check_special_id("mask_id", special.mask, config)
    eos = optional_eos_id(special.eos, config)
    knobs = MDMKnobs(mask_id=np.int32(mask))
    settings = MDMSettings(self.gen_length, self.block_length, self.steps, sample=sample)
    return Decoder(self, settings, knobs, eos)
