"""ReFusion plan-and-infill decoding, batched and jitted end to end (docs/method.md §2, §3).

The whole decode is one `jax.jit`-compiled `lax.while_loop`. Every loop
iteration is ONE model forward for all rows against a fixed-capacity
`KVCache`. Each row decodes one serial block of T = G / serial_blocks tokens
at a time, is in its own *stage*, and builds its own query from it, laid out
by block offset (slots in original order):

| stage  | query tokens                          | a block token sees (besides the cache) |
| ------ | ------------------------------------- | -------------------------------------- |
| plan   | mask ids                              | earlier tokens of undecided slots      |
| verify | the chosen slots' drafts              | earlier tokens of chosen slots         |
| draft  | drafts, unaccepted tokens as mask ids | earlier tokens of its own slot         |
| check  | the chosen slots' drafts              | earlier tokens of its own slot         |

The block-diagonal mask of draft/check replaces the official code's
per-slot copies of the cache. Only a stage's *active* slots (undecided ones
for a plan, chosen ones otherwise) matter: no active token sees another
slot's. So the forward runs only as wide as the work: the active slots are
moved into the leading columns (`refusion_jax.decoding.scheduler`) and the forward runs at the smallest of a few
compiled widths (S, 2S, 4S, ... up to T) that holds every row's active
tokens, chosen inside the loop by `lax.switch`; its token scores go back to
the block layout, where the stage logic reads them. Each forward's KV is staged
after the row's cache entries in compact order, and a commit, always a prefix
of the active tokens, makes that many of them valid
(`refusion_jax.model.cache.stage` / `commit`).

Rows advance independently. The method is the `ReFusion` value (its class a
`contract.Method`), run by `refusion_jax.decoding.engine.decode`: with
`batch_size`, a finished row takes the next queued prompt
(`refusion_jax.decoding.batching`), continuous batching, each prompt decoded
exactly as it would be alone.
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
from refusion_jax.decoding.checks import (
  check_choice,
  check_count,
  check_flag,
  check_slot_layout,
  check_special_id,
  check_temperature,
  check_threshold,
)
from refusion_jax.decoding.contract import DecodeOutputs, Decoder, MethodFacts, Sampling
from refusion_jax.decoding.prompts import prefill
from refusion_jax.decoding.result import (
  PHASE_INFILL,
  PHASE_VERIFY,
  STAGE_CHECK,
  STAGE_DRAFT,
  STAGE_NAMES,
  STAGE_PLAN,
  STAGE_VERIFY,
  DecodeResult,
)
from refusion_jax.decoding.scheduler import BlockQuery, ForwardLayout, TokenScores, scheduled_forward
from refusion_jax.decoding.scoring import sampling_noise
from refusion_jax.model import cache as kv_cache
from refusion_jax.model.cache import KVCache
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer

__all__ = ["ACCEPTANCE_RULES", "ReFusion", "ReFusionKnobs", "ReFusionSettings", "start_rows"]

# How a slot's tokens after its first are accepted: the official decoder's probability thresholds, or the
# speculative rule whose every answer is a sample of a named distribution (docs/method.md §6).
ACCEPTANCE_RULES = ("threshold", "speculative")


@dataclasses.dataclass(frozen=True)
class ReFusionSettings:
  """What fixes the compiled program (a static, hashable jit argument)."""

  gen_length: int
  slot_size: int
  serial_blocks: int
  # Gumbel noise on the plan step (temperature > 0); the temperature itself is traced.
  sample: bool
  # The speculative acceptance rule (docs/method.md §6): exact samples of a named policy; False: the official
  # threshold rule.
  speculative: bool = False
  # Forwards only as wide as the active slots (False: always the whole block, one compiled width).
  fit_width: bool = True
  # Narrow forwards of fewer rows than K (`scheduler.forward_shapes`); False on a TPU and where rows are split
  # over devices (the engine decides: `mesh.pick_rows_on`).
  pick_rows: bool = True

  @property
  def block_length(self) -> int:
    return self.gen_length // self.serial_blocks

  @property
  def slots_per_block(self) -> int:
    return self.block_length // self.slot_size

  @property
  def layout(self) -> ForwardLayout:
    """What the scheduler fits forwards into."""
    return ForwardLayout(self.slot_size, self.block_length, self.fit_width, self.pick_rows)

  @property
  def widths(self) -> tuple[int, ...]:
    """The compiled query widths: S, 2S, 4S, ... below T, then T (only T without fit_width)."""
    return self.layout.widths


@flax.struct.dataclass
class ReFusionKnobs:
  """Scalars that change nothing in the compiled program (traced jit arguments)."""

  slot_threshold: jax.Array  # float32
  token_threshold: jax.Array  # float32
  mask_id: jax.Array  # int32
  eos_id: jax.Array  # int32


@flax.struct.dataclass
class _RowState:
  """Per-row decode state (K rows). N = slots per block, T = block length.

  cache:         the KV cache, capacity = prompt bucket + G
  prompt_length: [K] int32 true length of the row's prompt
  stage:         [K] int32 STAGE_* of the next forward
  block:         [K] int32 serial block being decoded
  undecided:     [K, N] bool slots of the block not yet committed or dropped
  chosen:        [K, N] bool slots chosen by the last plan (still alive in the infill)
  accepted:      [K, N] int32 accepted prefix length of each chosen slot (infill)
  drafts:        [K, T] int32 current drafts of the chosen slots
  draft_logprob: [K, T] float32 each draft's log-probability under the distribution it was drawn from
  eos_seen:      [K] bool an EOS was committed: no later block is started
  waited:        [K] int32 iterations the row has waited for a forward
  """

  cache: kv_cache.KVCache
  prompt_length: jax.Array
  stage: jax.Array
  block: jax.Array
  undecided: jax.Array
  chosen: jax.Array
  accepted: jax.Array
  drafts: jax.Array
  draft_logprob: jax.Array
  eos_seen: jax.Array
  waited: jax.Array


def _fresh_rows(settings: ReFusionSettings, batch: int) -> _RowState:
  """Every field but the cache for `batch` rows at the start of a prompt (the cache is set apart)."""
  N, T = settings.slots_per_block, settings.block_length
  zeros = jnp.zeros((batch,), jnp.int32)
  return _RowState(
    cache=None,
    prompt_length=zeros,
    stage=jnp.full((batch,), STAGE_PLAN, jnp.int32),
    block=zeros,
    undecided=jnp.ones((batch, N), bool),
    chosen=jnp.zeros((batch, N), bool),
    accepted=jnp.zeros((batch, N), jnp.int32),
    drafts=jnp.zeros((batch, T), jnp.int32),
    draft_logprob=jnp.zeros((batch, T), jnp.float32),
    eos_seen=jnp.zeros((batch,), bool),
    waited=zeros,
  )


def _per_token(per_slot: jax.Array, slot_size: int) -> jax.Array:
  """[B, N] -> [B, N * S]: each slot's value on each of its tokens."""
  return jnp.repeat(per_slot, slot_size, axis=-1)


def _leading_run(passes: jax.Array, slot_size: int) -> jax.Array:
  """[B, T] bool -> [B, N] length of each slot's leading run of True (cumulative product)."""
  batch, length = passes.shape
  slots = passes.reshape(batch, length // slot_size, slot_size)
  return jnp.sum(jnp.cumprod(slots.astype(jnp.int32), axis=-1), axis=-1)


def _offset_in_slot(settings: ReFusionSettings) -> jax.Array:
  """[T] each block token's index inside its slot."""
  return jnp.arange(settings.block_length) % settings.slot_size


def _first_true(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """[B, K] bool -> whether any is True [B] and the index of the first [B] (0 when none)."""
  return jnp.any(x, axis=-1), jnp.argmax(x, axis=-1)


def _query(state: _RowState, settings: ReFusionSettings, mask_id: jax.Array):
  """Each row's query tokens [B, T] and which block tokens each query sees [B, T, T]."""
  S, T = settings.slot_size, settings.block_length
  offset = _offset_in_slot(settings)
  slot = jnp.arange(T) // S
  causal = jnp.tril(jnp.ones((T, T), bool))
  same_slot = slot[:, None] == slot[None, :]
  stage = state.stage[:, None]

  unaccepted = offset[None, :] >= _per_token(state.accepted, S)
  masked = (stage == STAGE_PLAN) | ((stage == STAGE_DRAFT) & unaccepted)
  tokens = jnp.where(masked, mask_id, state.drafts)

  in_infill = ((state.stage == STAGE_DRAFT) | (state.stage == STAGE_CHECK))[:, None, None]
  keys = jnp.where(stage == STAGE_PLAN, _per_token(state.undecided, S), _per_token(state.chosen, S))
  sees = causal[None] & keys[:, None, :]
  sees = jnp.where(in_infill, causal[None] & same_slot[None], sees)
  return tokens, sees


def _chosen_slots(confidence: jax.Array, state: _RowState, knobs: ReFusionKnobs, settings: ReFusionSettings):
  """Step 1's choice [B, N]: the undecided slots whose confidence [B, N] is above the slot threshold, else the
  single most confident one."""
  confident = state.undecided & (confidence > knobs.slot_threshold)
  best = jnp.argmax(jnp.where(state.undecided, confidence, -1.0), axis=-1)
  single = jax.nn.one_hot(best, settings.slots_per_block, dtype=bool)
  return jnp.where(jnp.any(confident, axis=-1, keepdims=True), confident, single)


def _global_verify(scores: TokenScores, state: _RowState, knobs: ReFusionKnobs, settings: ReFusionSettings):
  """Step 2 on the chosen drafts, causal over the chosen tokens in slot order.

  Returns:
    take [B, T] tokens to commit now (the whole slots of the passing prefix,
    or up to the first EOS in it; all False to go to the infill) and the
    per-slot accepted prefixes [B, N] the infill starts from.
  """
  S, T = settings.slot_size, settings.block_length
  chosen_tok = _per_token(state.chosen, S)
  first_of_slot = _offset_in_slot(settings) == 0
  passes = first_of_slot[None] | (scores.previous_prob > knobs.token_threshold)
  # The prefix of the chosen tokens' concatenation: unchosen tokens are skipped, not failed.
  in_prefix = chosen_tok & (jnp.cumsum(chosen_tok & ~passes, axis=-1) == 0)
  has_eos, eos_at = _first_true(in_prefix & (state.drafts == knobs.eos_id))
  whole = jnp.all(in_prefix.reshape(-1, T // S, S), axis=-1)
  up_to_eos = chosen_tok & (jnp.arange(T)[None] <= eos_at[:, None])
  take = jnp.where(has_eos[:, None], up_to_eos, _per_token(whole, S))
  return take, _leading_run(passes, S)


def _infill_draft(scores: TokenScores, state: _RowState, settings: ReFusionSettings):
  """Step 3a: argmax drafts for the chosen slots' unaccepted tokens; returns the drafts [B, T] and which were
  drawn again [B, T]."""
  S = settings.slot_size
  unaccepted = _offset_in_slot(settings)[None] >= _per_token(state.accepted, S)
  redraft = _per_token(state.chosen, S) & unaccepted
  return jnp.where(redraft, scores.greedy, state.drafts), redraft


def _infill_check(scores: TokenScores, state: _RowState, knobs: ReFusionKnobs, settings: ReFusionSettings):
  """Steps 3b-c: grow each slot's accepted prefix, stop at the first EOS slot.

  Returns:
    chosen [B, N] (slots after the first EOS slot dropped), accepted [B, N],
    and take [B, T]: the tokens to commit, all False until every chosen slot
    is accepted.
  """
  S = settings.slot_size
  # Accepted tokens and the first one after them pass without a test.
  forced = _offset_in_slot(settings)[None] <= _per_token(state.accepted, S)
  passes = forced | (scores.previous_prob > knobs.token_threshold)
  return _close_slots(state.drafts, state.chosen, _leading_run(passes, S), knobs, settings)


def _close_slots(drafts, chosen, accepted, knobs: ReFusionKnobs, settings: ReFusionSettings):
  """An accepted EOS ends its slot and drops the chosen slots after it; once every chosen slot is accepted, its
  tokens are taken, up to the first EOS.

  Args:
    drafts: [B, T] the chosen slots' tokens; chosen: [B, N]; accepted: [B, N] each slot's accepted prefix.

  Returns:
    chosen [B, N], accepted [B, N] and take [B, T] (all False until every chosen slot is accepted).
  """
  S, T = settings.slot_size, settings.block_length
  offset = _offset_in_slot(settings)
  is_eos = drafts == knobs.eos_id
  accepted_eos = _per_token(chosen, S) & (offset[None] < _per_token(accepted, S)) & is_eos
  has_eos, eos_slot = _first_true(jnp.any(accepted_eos.reshape(-1, T // S, S), axis=-1))
  slot_index = jnp.arange(T // S)[None]
  chosen = chosen & ~(has_eos[:, None] & (slot_index > eos_slot[:, None]))
  accepted = jnp.where(has_eos[:, None] & (slot_index == eos_slot[:, None]), S, accepted)
  done = jnp.all(~chosen | (accepted == S), axis=-1)

  chosen_tok = _per_token(chosen, S)
  cut_eos, cut_at = _first_true(chosen_tok & is_eos)
  take = chosen_tok & (~cut_eos[:, None] | (jnp.arange(T)[None] <= cut_at[:, None]))
  return chosen, accepted, take & done[:, None]


def _speculative(scores: TokenScores, state: _RowState, knobs: ReFusionKnobs, settings: ReFusionSettings, stage):
  """One forward of the speculative rule (docs/method.md §6) for rows in `stage` [B] (plan, draft or check).

  A plan chooses slots by the model's confidence (its largest probability at each slot's first token, not the
  draw) and keeps each chosen slot's first draw. A check grows each slot's accepted prefix by the run of drafts
  equal to the AR draws made with the same noise, then by the first AR draw that differs; a draft grows it by the
  AR draw after the accepted prefix and draws the slot's remaining tokens again from their masks. So every token
  after a slot's first is a draw of the AR distribution given the slot's earlier tokens.

  Returns:
    drafts [B, T], their log-probabilities [B, T], chosen [B, N], accepted [B, N], take [B, T] (the tokens to
    commit) and full [B] (every chosen slot is accepted, committed or not).
  """
  S = settings.slot_size
  is_plan, is_check = (stage == STAGE_PLAN)[:, None], (stage == STAGE_CHECK)[:, None]
  confidence = jnp.exp(scores.greedy_logprob[:, ::S])
  chosen = jnp.where(is_plan, _chosen_slots(confidence, state, knobs, settings), state.chosen)
  chosen_tok = _per_token(chosen, S)
  offset = _offset_in_slot(settings)[None]
  before = offset < _per_token(state.accepted, S)
  matches = is_check & (state.drafts == scores.next_draw)
  grown = jnp.minimum(_leading_run(before | matches, S) + 1, S)
  accepted = jnp.where(is_plan, jnp.where(chosen, 1, 0), grown)
  new = chosen_tok & ~before & (offset < _per_token(accepted, S))
  redraw = chosen_tok & ~is_check & (offset >= _per_token(accepted, S))
  drafts = jnp.where(new & ~is_plan, scores.next_draw, state.drafts)
  logprob = jnp.where(new & ~is_plan, scores.next_logprob, state.draft_logprob)
  drafts = jnp.where(is_plan | redraw, scores.planned, drafts)
  logprob = jnp.where(is_plan | redraw, scores.planned_logprob, logprob)
  chosen, accepted, take = _close_slots(drafts, chosen, accepted, knobs, settings)
  # The cache holds the keys and values of the tokens this forward was fed: only a check fed with every token
  # taken may commit them; slots completed by draws it was not fed take one more check.
  full = jnp.any(take, axis=-1)
  fed = jnp.all(~take | (drafts == state.drafts), axis=-1)
  return drafts, logprob, chosen, accepted, take & (is_check & fed[:, None]), full


def _commit(state: _RowState, out: DecodeOutputs, take, settings, eos_id, entry, phase):
  """Commit the taken tokens [B, T] (block order), record them under each row's queue `entry` [B], and take
  their slots out of the pool.

  The cache holds the forward's keys and values staged in compact order
  (`scheduler.scheduled_forward`); the taken tokens are a prefix of them, so
  committing is making that many entries valid.

  Slots after a committed EOS are dropped too (docs/method.md §2: only those after
  the EOS slot, unlike the official code).
  """
  S, T = settings.slot_size, settings.block_length
  cache = kv_cache.commit(state.cache, jnp.sum(take, axis=-1))
  has_eos, eos_at = _first_true(take & (state.drafts == eos_id))
  slot_index = jnp.arange(T // S)[None]
  removed = jnp.any(take.reshape(-1, T // S, S), axis=-1)
  removed |= has_eos[:, None] & (slot_index > (eos_at // S)[:, None])

  target = jnp.where(take, state.block[:, None] * T + jnp.arange(T)[None], settings.gen_length)
  rows = entry[:, None]
  iteration = out.steps.at[entry].get(mode="fill", fill_value=0) - 1
  out = out.replace(
    answer=out.answer.at[rows, target].set(state.drafts, mode="drop"),
    commit_iteration=out.commit_iteration.at[rows, target].set(
      jnp.broadcast_to(iteration[:, None], take.shape), mode="drop"
    ),
    commit_phase=out.commit_phase.at[rows, target].set(jnp.broadcast_to(phase[:, None], take.shape), mode="drop"),
    logprob=out.logprob.at[rows, target].set(state.draft_logprob, mode="drop"),
  )
  state = state.replace(cache=cache, undecided=state.undecided & ~removed, eos_seen=state.eos_seen | has_eos)
  return state, out


def _step(
  model: Transformer,
  knobs: ReFusionKnobs,
  settings: ReFusionSettings,
  state: _RowState,
  out: DecodeOutputs,
  widths: jax.Array,
  live: jax.Array,
  entry: jax.Array,
  sampling: Sampling,
) -> tuple[_RowState, DecodeOutputs, jax.Array, jax.Array]:
  """One forward for all rows, then each live row advances by its stage (a `contract.Step`)."""
  S, T = settings.slot_size, settings.block_length
  stage = state.stage
  steps = out.steps.at[entry].get(mode="fill", fill_value=0)
  tokens, sees = _query(state, settings, knobs.mask_id)
  positions = (state.prompt_length + state.block * T)[:, None] + jnp.arange(T)[None]
  active = _per_token(jnp.where((stage == STAGE_PLAN)[:, None], state.undecided, state.chosen) & live[:, None], S)
  noise = None
  if settings.sample:
    # The threshold rule draws fresh noise per plan step; the speculative rule one noise per answer position,
    # the same in every forward of its block (docs/method.md §6).
    draw_key = state.block if settings.speculative else steps
    noise = sampling_noise(sampling.key, sampling.temperature, draw_key, (T, model.config.vocab_size))
  query = BlockQuery(tokens=tokens, positions=positions, sees=sees, active=active, noise=noise, rule=sampling.rule)
  scores, cache, served, width = scheduled_forward(
    model, state.cache, state.waited, query, live, settings.layout, next_draws=settings.speculative
  )
  waiting = live & ~served
  live = served  # this iteration, only the rows that ran advance
  state = state.replace(cache=cache, waited=jnp.where(waiting, state.waited + 1, 0))
  stage_counts = jnp.sum(live[None] & (stage[None] == jnp.arange(len(STAGE_NAMES))[:, None]), axis=-1)
  widths = count_width(widths, width, jnp.concatenate([jnp.ones(1), stage_counts]))

  row = lambda flags: flags[:, None]
  is_plan, is_verify = live & (stage == STAGE_PLAN), live & (stage == STAGE_VERIFY)
  is_draft, is_check = live & (stage == STAGE_DRAFT), live & (stage == STAGE_CHECK)
  if settings.speculative:
    drafts, logprob, chosen, accepted, take, full = _speculative(scores, state, knobs, settings, stage)
    keep = lambda new, old: jnp.where(row(live), new, old)
    take = row(live) & take
    state = state.replace(
      drafts=keep(drafts, state.drafts),
      draft_logprob=keep(logprob, state.draft_logprob),
      chosen=keep(chosen, state.chosen),
      accepted=keep(accepted, state.accepted),
    )
  else:
    plan_chosen = _chosen_slots(scores.planned_prob[:, ::S], state, knobs, settings)
    verify_take, verify_accepted = _global_verify(scores, state, knobs, settings)
    check_chosen, check_accepted, check_take = _infill_check(scores, state, knobs, settings)
    infill_drafts, redrawn = _infill_draft(scores, state, settings)
    redrawn = row(is_draft) & redrawn
    drafts = jnp.where(row(is_plan), scores.planned, jnp.where(redrawn, infill_drafts, state.drafts))
    logprob = jnp.where(row(is_plan), scores.planned_logprob, state.draft_logprob)
    take = (row(is_verify) & verify_take) | (row(is_check) & check_take)
    state = state.replace(
      drafts=drafts,
      draft_logprob=jnp.where(redrawn, scores.greedy_logprob, logprob),
      chosen=jnp.where(row(is_plan), plan_chosen, jnp.where(row(is_check), check_chosen, state.chosen)),
      accepted=jnp.where(row(is_verify), verify_accepted, jnp.where(row(is_check), check_accepted, state.accepted)),
    )
  committed = jnp.any(take, axis=-1)
  out = out.replace(
    num_forwards=out.num_forwards.at[entry].add(live, mode="drop"),
    steps=out.steps.at[entry].add(is_plan, mode="drop"),
  )
  phase = jnp.where(stage == STAGE_VERIFY, PHASE_VERIFY, PHASE_INFILL)
  state, out = _commit(state, out, take, settings, knobs.eos_id, entry, phase)

  if settings.speculative:  # plan -> check, check -> draft -> check ..., until a check commits the chosen slots
    next_stage = jnp.select([live & committed, is_check & ~full, live], [STAGE_PLAN, STAGE_DRAFT, STAGE_CHECK], stage)
  else:
    next_stage = jnp.select(
      [is_plan, is_verify | is_check, is_draft],
      [STAGE_VERIFY, jnp.where(committed, STAGE_PLAN, STAGE_DRAFT), STAGE_CHECK],
      stage,
    )
  block_done = live & committed & ~jnp.any(state.undecided, axis=-1)
  finish = block_done & (state.eos_seen | (state.block == settings.serial_blocks - 1))
  advance = block_done & ~finish
  state = state.replace(stage=next_stage, block=state.block + advance, undecided=state.undecided | row(advance))
  return state, out, widths, finish


def _admit(
  model: Transformer,
  knobs: ReFusionKnobs,
  settings: ReFusionSettings,
  state: _RowState,
  out: DecodeOutputs,
  row: jax.Array,
  entry: jax.Array,
  sampling: Sampling,
  tokens: jax.Array,
  length: jax.Array,
) -> tuple[_RowState, DecodeOutputs]:
  """Prefill the prompt of `entry` ([P] tokens, true length) into row `row` and reset its state (a `contract.Admit`)."""
  del knobs, sampling  # the prefill draws nothing
  _, one = prefill(model, tokens[None], length[None], state.cache.capacity)
  state = put_row(state, row, _fresh_rows(settings, 1).replace(cache=one, prompt_length=length[None]))
  # The prompt prefill is a forward too; counting it keeps TPF comparable
  # with the AR baseline, whose prefill yields its first token.
  return state, out.replace(num_forwards=out.num_forwards.at[entry].set(1))


def _rows(settings: ReFusionSettings, config: ModelConfig, rows: int, capacity: int) -> _RowState:
  return _fresh_rows(settings, rows).replace(cache=KVCache.create(config, rows, capacity))


def start_rows(
  settings: ReFusionSettings, config: ModelConfig, rows: int, prompt_width: int
) -> tuple[_RowState, np.ndarray]:
  """Idle rows (cache capacity = prompt bucket + G) and zero width counters (a `contract.StartRows`)."""
  state = host_zeros(_rows, settings, config, rows, prompt_width + settings.gen_length)
  return state, np.zeros((1 + len(STAGE_NAMES), settings.block_length + 1), np.int32)


@dataclasses.dataclass(frozen=True)
class ReFusion(MethodFacts):
  """ReFusion plan-and-infill decoding (docs/method.md §2) as a typed, hashable value: `rj.decode(model, ids,
  ReFusion(...))`. Checked when built; the defaults are the paper's settings scaled to short CPU demos.

  Temperature > 0 samples the plan step by Gumbel-max (prompt i, plan step s draws its noise from
  fold_in(fold_in(key(seed), i), s), so results are reproducible per seed whatever the batching); slot
  confidence stays the un-noised probability of the drafted first token. Infill drafts are always argmax.

  Attributes:
    gen_length: G, answer tokens, a multiple of slot_size × serial_blocks.
    slot_size: S, tokens per slot.
    serial_blocks: NB, blocks of G / NB tokens decoded left to right.
    slot_threshold: a slot is chosen when its confidence is > this, in (0, 1].
    token_threshold: a drafted token passes verification when its AR probability is > this, in (0, 1].
    temperature: 0 for greedy plans, else Gumbel-max sampling at that temperature.
    fit_width: run each forward only as wide as the rows' active slots (a few compiled widths); False:
      always the whole block (one compiled width, which can pay off where a forward costs the same at any
      small width).
    acceptance: "threshold", the official rule (token_threshold decides which drafts are kept), or
      "speculative": every answer a draw of a named distribution whose log-probability the decoder reports,
      exactly (docs/method.md §6; token_threshold unused).

  A decode's `DecodeResult`: num_forwards counts the prompt prefill and every plan, verification, infill
  draft and infill verify pass; steps counts plans; commit_iteration is the plan step whose cycle committed
  each answer position and commit_phase PHASE_VERIFY or PHASE_INFILL; widths the forwards by query width,
  overall and per stage.
  """

  name: ClassVar[str] = "refusion"
  width_names: ClassVar[tuple[str, ...]] = ("forward", *STAGE_NAMES)
  start_rows: ClassVar = staticmethod(start_rows)
  admit: ClassVar = staticmethod(_admit)
  step: ClassVar = staticmethod(_step)

  gen_length: int = 64
  slot_size: int = 4
  serial_blocks: int = 1
  slot_threshold: float = 0.9
  token_threshold: float = 0.9
  temperature: float = 0.0
  fit_width: bool = True
  acceptance: str = "threshold"

  def __post_init__(self) -> None:
    check_count("gen_length", self.gen_length, 64)
    check_choice("acceptance", self.acceptance, ACCEPTANCE_RULES)
    check_count("slot_size", self.slot_size, 4)
    check_count("serial_blocks", self.serial_blocks, 1)
    check_slot_layout(self.gen_length, self.slot_size, self.serial_blocks)
    check_threshold("slot_threshold", self.slot_threshold)
    check_threshold("token_threshold", self.token_threshold)
    check_temperature(self.temperature)
    check_flag("fit_width", self.fit_width)

  @property
  def speculative(self) -> bool:
    return self.acceptance == "speculative"

  @property
  def reference_fields(self) -> dict:
    """The fields the eager reference decoder (`reference.decode_reference`) and the official one take: all but
    `fit_width` (both run whole blocks) and `acceptance` (both are the threshold rule, which they must be)."""
    if self.speculative:
      raise ValueError("The eager reference and the official decoder implement the threshold rule only.")
    fields = dataclasses.asdict(self)
    del fields["fit_width"], fields["acceptance"]
    return fields

  @property
  def label(self) -> str:
    if self.speculative:
      return f"refusion S{self.slot_size} {self.slot_threshold:g} speculative"
    return f"refusion S{self.slot_size} {self.slot_threshold:g}/{self.token_threshold:g}"

  @property
  def answer_grid(self) -> int:
    return self.slot_size * self.serial_blocks

  @property
  def token_grid(self) -> int:
    return self.slot_size

  def resized(self, gen_length: int) -> ReFusion:
    """ReFusion for G = `gen_length`: the same slots, and as many serial blocks as before where G splits into
    them, else the most fewer that split G's slots evenly (`fitted_serial_blocks`: the paper's gsm8k_cot NB = 4 at
    G = 64, S = 32 is 2)."""
    blocks = self.serial_blocks
    if gen_length % (self.slot_size * blocks) and gen_length % self.slot_size == 0:
      blocks = fitted_serial_blocks(gen_length // self.slot_size, blocks)
    return dataclasses.replace(self, gen_length=gen_length, serial_blocks=blocks)

  def official_tpf(self, result: DecodeResult, row: int) -> float:
    """The official harness's TPF of one answer: the mean over its plan-and-infill cycles of S·slots ÷ the
    cycle's forwards (docs/method.md §4).

    A cycle is a plan and a global verification, plus a draft and a check per
    infill iteration when the verification commits nothing: S·slots / 2 or
    S·slots / (2 + 2n) after n infill iterations (the `sum_TPF` terms of the
    official generate.py, whose mean over cycles its harness reports as TPF).
    The decode result gives each cycle's slots and phase, and each answer's
    infill iterations only in all: they are spread evenly over its infill
    cycles, which is exact when an answer has at most one infill cycle or all
    take as many.
    """
    length = len(result.tokens[row])
    cycles = result.commit_iteration[row, :length]
    phases = result.commit_phase[row, :length]
    committed = np.unique(cycles[cycles >= 0])
    if len(committed) == 0:
      return 0.0
    # Forwards: the prefill, a plan and a verification per cycle, a draft and a check per infill iteration.
    infill_iterations = (int(result.num_forwards[row]) - 1 - 2 * int(result.steps[row])) / 2
    infill = {int(c) for c in committed if phases[cycles == c][0] != PHASE_VERIFY}
    per_infill_cycle = infill_iterations / max(len(infill), 1)
    total = 0.0
    for cycle in committed:
      slots = len(np.unique(np.flatnonzero(cycles == cycle) // self.slot_size))
      total += self.slot_size * slots / (2 + 2 * (per_infill_cycle if int(cycle) in infill else 0))
    return total / len(committed)

  def decoder(self, config: ModelConfig, special: SpecialTokens, *, pick_rows: bool, sample: bool) -> Decoder:
    """The settings and knobs of one decode call (a `contract.Method`); the mask and EOS ids must be known."""
    mask_id = check_special_id("mask_id", special.mask, config)
    eos_id = check_special_id("eos_id", special.eos, config)
    knobs = ReFusionKnobs(
      slot_threshold=np.float32(self.slot_threshold),
      token_threshold=np.float32(self.token_threshold),
      mask_id=np.int32(mask_id),
      eos_id=np.int32(eos_id),
    )
    settings = ReFusionSettings(
      self.gen_length,
      self.slot_size,
      self.serial_blocks,
      sample,
      speculative=self.speculative,
      fit_width=self.fit_width,
      pick_rows=pick_rows,
    )
    return Decoder(self, settings, knobs, eos_id)


def fitted_serial_blocks(slots: int, serial_blocks: int) -> int:
  """The most serial blocks, at most `serial_blocks`, that split `slots` slots evenly."""
  return max(n for n in range(1, min(slots, serial_blocks) + 1) if slots % n == 0)
