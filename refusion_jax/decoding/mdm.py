"""The masked-diffusion baseline: LLaDA-style decoding with low-confidence remasking, on ReFusion's backbone.

No cache: every step is one bidirectional forward over prompt + answer. The
answer is decoded in semi-autoregressive blocks, and per step the most
confident masked tokens of the current block are unmasked (LLaDA's
`generate.py`). An `MDM` `contract.Method`: batched and jitted end to end as one
`lax.while_loop` over a `refusion_jax.decoding.batching.LoopState` (so
`batch_size` gives continuous batching), run by
`refusion_jax.decoding.driver.run_decoder`, whose `DecodeResult` records
`PHASE_STEP` for every token.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from refusion_jax.decoding.batching import DecodeOutputs, count_width, put_row
from refusion_jax.decoding.checks import check_special_id, check_temperature, decoder_special_tokens, optional_eos_id
from refusion_jax.decoding.contract import Method
from refusion_jax.decoding.driver import Decoder, run_decoder
from refusion_jax.decoding.result import PHASE_NONE, PHASE_STEP, DecodeResult
from refusion_jax.decoding.scoring import pick_tokens
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer


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
  """Scalars that change nothing in the compiled program (traced): Gumbel-max temperature and key, the mask id."""

  key: jax.Array
  temperature: jax.Array
  mask_id: jax.Array


@flax.struct.dataclass
class _RowState:
  """Per-row state (K rows, P = prompt bucket).

  prompt:        [K, P] int32 right-padded prompt
  prompt_length: [K] int32
  answer:        [K, G] int32 the answer so far, mask ids where still masked
  committed_at:  [K, G] int32 step that unmasked each offset, -1 where none
  """

  prompt: jax.Array
  prompt_length: jax.Array
  answer: jax.Array
  committed_at: jax.Array


def _admit(
  model: Transformer,
  knobs: MDMKnobs,
  schedule: MDMSettings,
  state: _RowState,
  out: DecodeOutputs,
  row: jax.Array,
  entry: jax.Array,
  prompt: jax.Array,
  tokens: jax.Array,
  length: jax.Array,
) -> tuple[_RowState, DecodeOutputs]:
  """Put the prompt of `entry` into row `row` with a fully masked answer (a `contract.Admit`; no forward)."""
  del model, entry, prompt  # no prefill: the first step reads the prompt
  G = schedule.gen_length
  fresh = _RowState(
    prompt=tokens[None],
    prompt_length=length[None],
    answer=jnp.full((1, G), knobs.mask_id, jnp.int32),
    committed_at=jnp.full((1, G), -1, jnp.int32),
  )
  return put_row(state, row, fresh), out


def _step(
  model: Transformer,
  knobs: MDMKnobs,
  schedule: MDMSettings,
  state: _RowState,
  out: DecodeOutputs,
  widths: jax.Array,
  live: jax.Array,
  entry: jax.Array,
  prompt: jax.Array,
) -> tuple[_RowState, DecodeOutputs, jax.Array, jax.Array]:
  """One unmasking step of every row: a bidirectional forward over [prompt bucket | answer] (a `contract.Step`).

  The prompt keeps its right padding and the answer follows the bucket, but
  every token carries its true position (answer j sits at length + j) and no
  query sees padding, so with bidirectional attention this equals LLaDA's
  contiguous layout.
  """
  batch, width = state.prompt.shape
  G, per_block = schedule.gen_length, schedule.steps_per_block
  transfer_counts = jnp.asarray(num_transfer_tokens(schedule.block_length, per_block))
  step = out.steps.at[entry].get(mode="fill", fill_value=0)

  columns = jnp.arange(width)[None, :]
  positions = jnp.concatenate(
    [jnp.broadcast_to(columns, (batch, width)), state.prompt_length[:, None] + jnp.arange(G)], 1
  )
  key_valid = jnp.concatenate([columns < state.prompt_length[:, None], jnp.ones((batch, G), bool)], 1)
  mask = jnp.broadcast_to(key_valid[:, None, :], (batch, width + G, width + G))
  logits, _ = model(jnp.concatenate([state.prompt, state.answer], 1), positions, mask)
  draft, confidence = pick_tokens(logits[:, width:], knobs.key, prompt, step, knobs.temperature, schedule.sample)
  block_of = jnp.arange(G) // schedule.block_length
  candidate = (state.answer == knobs.mask_id) & (block_of[None, :] == (step // per_block)[:, None])
  confidence = jnp.where(candidate, confidence, -jnp.inf)
  # Rank by confidence (stable: ties go to the earlier position) and take the top k.
  order = jnp.argsort(-confidence, axis=-1, stable=True)
  rank = jnp.argsort(order, axis=-1)
  transfer = candidate & (rank < transfer_counts[step % per_block][:, None]) & live[:, None]
  answer = jnp.where(transfer, draft, state.answer)
  committed_at = jnp.where(transfer, step[:, None], state.committed_at)

  out = out.replace(
    answer=out.answer.at[entry].set(answer, mode="drop"),
    commit_iteration=out.commit_iteration.at[entry].set(committed_at, mode="drop"),
    commit_phase=out.commit_phase.at[entry].set(jnp.where(committed_at >= 0, PHASE_STEP, PHASE_NONE), mode="drop"),
    num_forwards=out.num_forwards.at[entry].add(1, mode="drop"),
    steps=out.steps.at[entry].add(1, mode="drop"),
  )
  widths = count_width(widths, width + G, jnp.ones((1,), jnp.int32))
  state = state.replace(answer=answer, committed_at=committed_at)
  return state, out, widths, live & (step + 1 >= schedule.steps)


def start_rows(
  schedule: MDMSettings, config: ModelConfig, batch: int, prompt_width: int
) -> tuple[_RowState, np.ndarray]:
  """Idle rows and a zero count of the [prompt | answer]-wide forwards (a `contract.StartRows`)."""
  del config  # no cache
  G = schedule.gen_length
  state = _RowState(
    prompt=np.zeros((batch, prompt_width), np.int32),
    prompt_length=np.zeros((batch,), np.int32),
    answer=np.zeros((batch, G), np.int32),
    committed_at=np.zeros((batch, G), np.int32),
  )
  return state, np.zeros((1, prompt_width + G + 1), np.int32)


MDM = Method("mdm", start_rows, _admit, _step)


def mdm_generate(
  model: Transformer,
  prompt_ids: Sequence[Sequence[int]],
  *,
  gen_length: int,
  block_length: int,
  steps: int,
  mask_id: int | None = None,
  eos_id: int | None = None,
  pad_id: int | None = None,
  temperature: float = 0.0,
  seed: int = 0,
  mesh: jax.sharding.Mesh | None = None,
  batch_size: int | None = None,
  chunk_iterations: int | None = None,
) -> DecodeResult:
  """Batched LLaDA-style masked diffusion decoding with low-confidence remasking.

  The answer starts as G mask tokens, split into G / block_length blocks
  decoded left to right with steps / num_blocks steps each. Each step is one
  bidirectional forward over prompt + answer; of the current block's masked
  positions, the `num_transfer_tokens` most confident predictions are
  unmasked. Every row runs all `steps` forwards (as LLaDA does).

  Args:
    prompt_ids: N prompts of integer token ids.
    gen_length: G, a multiple of block_length.
    block_length: tokens per semi-autoregressive block.
    steps: total forwards, a multiple of the number of blocks and at most G.
    mask_id: defaults to the config's `mask_token_id`.
    eos_id: the answer is cut after its first EOS; defaults to the config's.
    temperature: 0 for greedy drafts, else Gumbel-max sampled drafts.
    pad_id, mesh, batch_size, chunk_iterations: prompt padding, the device mesh, the rows kept busy
      (continuous batching) and the iterations per loop call, as `refusion_jax.decoding.driver.run_decoder`
      takes them (defaults: the config's pad id, one device, all N prompts as one batch, one call).

  Returns:
    A `DecodeResult` in input order; commit_iteration is the step that unmasked each position.
  """
  config = model.config
  check_mdm_schedule(gen_length, block_length, steps)
  temperature = check_temperature(temperature)
  mask = check_special_id("mask_id", decoder_special_tokens(config, mask_id=mask_id).mask, config)
  eos = optional_eos_id(eos_id, config)
  knobs = MDMKnobs(key=jax.random.key(seed), temperature=jnp.float32(temperature), mask_id=jnp.int32(mask))
  decoder = Decoder(MDM, MDMSettings(gen_length, block_length, steps, sample=temperature > 0), knobs, eos)
  return run_decoder(
    model, prompt_ids, decoder, pad_id=pad_id, mesh=mesh, batch_size=batch_size, chunk_iterations=chunk_iterations
  )


def __getattr__(name: str):
  if name == "MDMSchedule":
    warnings.warn(
      "refusion_jax.decoding.mdm.MDMSchedule is renamed MDMSettings (as ReFusionSettings, ARSettings); "
      "MDMSchedule will be removed.",
      DeprecationWarning,
      stacklevel=2,
    )
    return MDMSettings
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
