"""ReFusion plan-and-infill decoding, batched and jitted end to end (docs/method.md §2, §3).

The whole decode is one `jax.jit`-compiled `lax.while_loop`. Every loop
iteration is ONE model forward for the whole batch over a query block of
T = G / serial_blocks tokens (one serial block, slots in original order)
against a fixed-capacity `KVCache`. Each row is in its own *stage* and builds
its own query from it:

| stage  | query tokens                          | a block token sees (besides the cache) |
| ------ | ------------------------------------- | -------------------------------------- |
| plan   | mask ids                              | earlier tokens of undecided slots      |
| verify | the chosen slots' drafts              | earlier tokens of chosen slots         |
| draft  | drafts, unaccepted tokens as mask ids | earlier tokens of its own slot         |
| check  | the chosen slots' drafts              | earlier tokens of its own slot         |

The block-diagonal mask of draft/check replaces the official code's
per-slot copies of the cache. Tokens of other slots sit in the query too but
no query sees them, so they change nothing. Commits append the kept tokens,
in slot order, with the KV of the same forward (`refusion_jax.model.cache.append`).
Rows advance independently; finished rows idle under a mask until every row
is done.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import chex
import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from refusion_jax.decoding.common import (
  PHASE_INFILL,
  PHASE_NONE,
  PHASE_VERIFY,
  DecodeOutputs,
  DecodeResult,
  check_refusion_knobs,
  counts_compilations,
  log_partition,
  prefill,
  row_gumbel_noise,
  run_decoder,
  token_probs,
)
from refusion_jax.decoding.sharding import row_sharded_while_loop
from refusion_jax.model import cache as kv_cache
from refusion_jax.model.transformer import Transformer

__all__ = ["DecodeKnobs", "DecodeSettings", "decode_loop", "generate"]

# Stage of a row: what its next forward is.
STAGE_PLAN, STAGE_VERIFY, STAGE_DRAFT, STAGE_CHECK = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
  """What fixes the compiled program (a static, hashable jit argument)."""

  gen_length: int
  slot_size: int
  serial_blocks: int
  # Gumbel noise on the plan step (temperature > 0); the temperature itself is traced.
  sample: bool

  @property
  def block_length(self) -> int:
    return self.gen_length // self.serial_blocks

  @property
  def slots_per_block(self) -> int:
    return self.block_length // self.slot_size


@flax.struct.dataclass
class DecodeKnobs:
  """Scalars that change nothing in the compiled program (traced jit arguments)."""

  slot_threshold: jax.Array  # float32
  token_threshold: jax.Array  # float32
  temperature: jax.Array  # float32
  key: jax.Array  # typed PRNG key of the plan noise
  mask_id: jax.Array  # int32
  eos_id: jax.Array  # int32


@flax.struct.dataclass
class _RowState:
  """The loop carry. N = slots per block, T = block length.

  cache:     the KV cache, capacity = prompt bucket + G
  stage:     [B] int32 STAGE_* of the next forward
  block:     [B] int32 serial block being decoded
  undecided: [B, N] bool slots of the block not yet committed or dropped
  chosen:    [B, N] bool slots chosen by the last plan (still alive in the infill)
  accepted:  [B, N] int32 accepted prefix length of each chosen slot (infill)
  drafts:    [B, T] int32 current drafts of the chosen slots
  eos_seen:  [B] bool an EOS was committed: no later block is started
  finished:  [B] bool
  """

  cache: kv_cache.KVCache
  stage: jax.Array
  block: jax.Array
  undecided: jax.Array
  chosen: jax.Array
  accepted: jax.Array
  drafts: jax.Array
  eos_seen: jax.Array
  finished: jax.Array
  out: DecodeOutputs


def _per_token(per_slot: jax.Array, slot_size: int) -> jax.Array:
  """[B, N] -> [B, N * S]: each slot's value on each of its tokens."""
  return jnp.repeat(per_slot, slot_size, axis=-1)


def _leading_run(passes: jax.Array, slot_size: int) -> jax.Array:
  """[B, T] bool -> [B, N] length of each slot's leading run of True (cumulative product)."""
  batch, length = passes.shape
  slots = passes.reshape(batch, length // slot_size, slot_size)
  return jnp.sum(jnp.cumprod(slots.astype(jnp.int32), axis=-1), axis=-1)


def _offset_in_slot(settings: DecodeSettings) -> jax.Array:
  """[T] each block token's index inside its slot."""
  return jnp.arange(settings.block_length) % settings.slot_size


def _first_true(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """[B, K] bool -> whether any is True [B] and the index of the first [B] (0 when none)."""
  return jnp.any(x, axis=-1), jnp.argmax(x, axis=-1)


def _previous_token_probs(logits: jax.Array, log_z: jax.Array, tokens: jax.Array) -> jax.Array:
  """AR probabilities: softmax(logits[b, t - 1])[tokens[b, t]], 1 at t = 0.

  Args:
    logits: [B, T, vocab]; log_z: [B, T] their `log_partition`; tokens: [B, T].
  """
  taken = token_probs(logits[:, :-1], log_z[:, :-1], tokens[:, 1:])
  return jnp.concatenate([jnp.ones_like(taken[:, :1]), taken], axis=1)


def _query(state: _RowState, settings: DecodeSettings, mask_id: jax.Array):
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


def _plan(logits, log_z, state: _RowState, knobs: DecodeKnobs, settings: DecodeSettings):
  """Step 1: drafts [B, T] of every slot and the chosen slots [B, N]."""
  scores = logits
  if settings.sample:
    scores = logits + knobs.temperature * row_gumbel_noise(knobs.key, state.out.steps, logits.shape[1:])
  drafts = jnp.argmax(scores, axis=-1).astype(jnp.int32)
  # Slot confidence: the un-noised probability of the slot's first drafted token.
  S = settings.slot_size
  first_prob = token_probs(logits[:, ::S], log_z[:, ::S], drafts[:, ::S])
  confident = state.undecided & (first_prob > knobs.slot_threshold)
  best = jnp.argmax(jnp.where(state.undecided, first_prob, -1.0), axis=-1)
  single = jax.nn.one_hot(best, settings.slots_per_block, dtype=bool)
  chosen = jnp.where(jnp.any(confident, axis=-1, keepdims=True), confident, single)
  return drafts, chosen


def _global_verify(logits, log_z, state: _RowState, knobs: DecodeKnobs, settings: DecodeSettings):
  """Step 2 on the chosen drafts, causal over the chosen tokens in slot order.

  Returns:
    take [B, T] tokens to commit now (the whole slots of the passing prefix,
    or up to the first EOS in it; all False to go to the infill) and the
    per-slot accepted prefixes [B, N] the infill starts from.
  """
  S, T = settings.slot_size, settings.block_length
  chosen_tok = _per_token(state.chosen, S)
  first_of_slot = _offset_in_slot(settings) == 0
  passes = first_of_slot[None] | (_previous_token_probs(logits, log_z, state.drafts) > knobs.token_threshold)
  # The prefix of the chosen tokens' concatenation: unchosen tokens are skipped, not failed.
  in_prefix = chosen_tok & (jnp.cumsum(chosen_tok & ~passes, axis=-1) == 0)
  has_eos, eos_at = _first_true(in_prefix & (state.drafts == knobs.eos_id))
  whole = jnp.all(in_prefix.reshape(-1, T // S, S), axis=-1)
  up_to_eos = chosen_tok & (jnp.arange(T)[None] <= eos_at[:, None])
  take = jnp.where(has_eos[:, None], up_to_eos, _per_token(whole, S))
  return take, _leading_run(passes, S)


def _infill_draft(logits, state: _RowState, settings: DecodeSettings):
  """Step 3a: argmax drafts for the chosen slots' unaccepted tokens."""
  S = settings.slot_size
  unaccepted = _offset_in_slot(settings)[None] >= _per_token(state.accepted, S)
  redraft = _per_token(state.chosen, S) & unaccepted
  return jnp.where(redraft, jnp.argmax(logits, axis=-1).astype(jnp.int32), state.drafts)


def _infill_check(logits, log_z, state: _RowState, knobs: DecodeKnobs, settings: DecodeSettings):
  """Steps 3b-c: grow each slot's accepted prefix, stop at the first EOS slot.

  Returns:
    chosen [B, N] (slots after the first EOS slot dropped), accepted [B, N],
    and take [B, T]: the tokens to commit, all False until every chosen slot
    is accepted.
  """
  S, T = settings.slot_size, settings.block_length
  offset = _offset_in_slot(settings)
  # Accepted tokens and the first one after them pass without a test.
  forced = offset[None] <= _per_token(state.accepted, S)
  passes = forced | (_previous_token_probs(logits, log_z, state.drafts) > knobs.token_threshold)
  accepted = _leading_run(passes, S)
  is_eos = state.drafts == knobs.eos_id
  accepted_eos = _per_token(state.chosen, S) & (offset[None] < _per_token(accepted, S)) & is_eos
  has_eos, eos_slot = _first_true(jnp.any(accepted_eos.reshape(-1, T // S, S), axis=-1))
  slot_index = jnp.arange(T // S)[None]
  chosen = state.chosen & ~(has_eos[:, None] & (slot_index > eos_slot[:, None]))
  accepted = jnp.where(has_eos[:, None] & (slot_index == eos_slot[:, None]), S, accepted)
  done = jnp.all(~chosen | (accepted == S), axis=-1)

  chosen_tok = _per_token(chosen, S)
  cut_eos, cut_at = _first_true(chosen_tok & is_eos)
  take = chosen_tok & (~cut_eos[:, None] | (jnp.arange(T)[None] <= cut_at[:, None]))
  return chosen, accepted, take & done[:, None]


def _commit(state: _RowState, kv, positions, take, settings: DecodeSettings, eos_id):
  """Append the taken tokens, record them, and take their slots out of the pool.

  Slots after a committed EOS are dropped too (docs/method.md §2: only those after
  the EOS slot, unlike the official code).
  """
  S, T = settings.slot_size, settings.block_length
  cache = kv_cache.append(state.cache, kv, positions, take)
  has_eos, eos_at = _first_true(take & (state.drafts == eos_id))
  slot_index = jnp.arange(T // S)[None]
  removed = jnp.any(take.reshape(-1, T // S, S), axis=-1)
  removed |= has_eos[:, None] & (slot_index > (eos_at // S)[:, None])

  out = state.out
  target = jnp.where(take, state.block[:, None] * T + jnp.arange(T)[None], settings.gen_length)
  rows = jnp.arange(take.shape[0])[:, None]
  phase = jnp.where(state.stage == STAGE_VERIFY, PHASE_VERIFY, PHASE_INFILL)
  out = out.replace(
    answer=out.answer.at[rows, target].set(state.drafts, mode="drop"),
    commit_iteration=out.commit_iteration.at[rows, target].set(
      jnp.broadcast_to((out.steps - 1)[:, None], take.shape), mode="drop"
    ),
    commit_phase=out.commit_phase.at[rows, target].set(jnp.broadcast_to(phase[:, None], take.shape), mode="drop"),
  )
  return state.replace(cache=cache, undecided=state.undecided & ~removed, eos_seen=state.eos_seen | has_eos, out=out)


def _step(
  model: Transformer, state: _RowState, prompt_lengths, knobs: DecodeKnobs, settings: DecodeSettings
) -> _RowState:
  """One forward for the whole batch, then each live row advances by its stage."""
  T = settings.block_length
  live = ~state.finished
  stage = state.stage
  tokens, sees = _query(state, settings, knobs.mask_id)
  positions = (prompt_lengths + state.block * T)[:, None] + jnp.arange(T)[None]
  logits, kv = model(tokens, positions, kv_cache.block_mask(state.cache, sees), state.cache)
  log_z = log_partition(logits)  # probabilities of given tokens only, never [B, T, vocab] (docs/method.md §3)

  is_plan, is_verify = live & (stage == STAGE_PLAN), live & (stage == STAGE_VERIFY)
  is_draft, is_check = live & (stage == STAGE_DRAFT), live & (stage == STAGE_CHECK)
  plan_drafts, plan_chosen = _plan(logits, log_z, state, knobs, settings)
  verify_take, verify_accepted = _global_verify(logits, log_z, state, knobs, settings)
  check_chosen, check_accepted, check_take = _infill_check(logits, log_z, state, knobs, settings)

  row = lambda flags: flags[:, None]
  drafts = jnp.where(row(is_plan), plan_drafts, state.drafts)
  drafts = jnp.where(row(is_draft), _infill_draft(logits, state, settings), drafts)
  take = (row(is_verify) & verify_take) | (row(is_check) & check_take)
  committed = jnp.any(take, axis=-1)
  out = state.out.replace(num_forwards=state.out.num_forwards + live, steps=state.out.steps + is_plan)
  state = state.replace(
    drafts=drafts,
    chosen=jnp.where(row(is_plan), plan_chosen, jnp.where(row(is_check), check_chosen, state.chosen)),
    accepted=jnp.where(row(is_verify), verify_accepted, jnp.where(row(is_check), check_accepted, state.accepted)),
    out=out,
  )
  state = _commit(state, kv, positions, take, settings, knobs.eos_id)

  next_stage = jnp.select(
    [is_plan, is_verify | is_check, is_draft],
    [STAGE_VERIFY, jnp.where(committed, STAGE_PLAN, STAGE_DRAFT), STAGE_CHECK],
    stage,
  )
  block_done = live & committed & ~jnp.any(state.undecided, axis=-1)
  finish = block_done & (state.eos_seen | (state.block == settings.serial_blocks - 1))
  advance = block_done & ~finish
  return state.replace(
    stage=next_stage,
    block=state.block + advance,
    undecided=state.undecided | row(advance),
    finished=state.finished | finish,
  )


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"))
@counts_compilations
def decode_loop(
  graphdef: nnx.GraphDef,
  params: nnx.State,
  prompt_tokens: jax.Array,
  prompt_lengths: jax.Array,
  knobs: DecodeKnobs,
  *,
  settings: DecodeSettings,
) -> DecodeOutputs:
  """Prefill the prompts, then run the plan-and-infill loop until every row is done.

  This is the compiled program `generate` calls; a serving loop can call it
  directly with `nnx.split(model)` and prompts from `decoding.pad_prompts`.
  Weights and every `DecodeKnobs` field are traced: only the graph, the
  settings and the shapes (batch, prompt bucket) cause a new compilation.

  Args:
    params: the model's `nnx.State`.
    prompt_tokens: [B, P] right-padded prompt ids (P = a prompt bucket).
    prompt_lengths: [B] int32 true prompt lengths; padding is never attended.

  Returns:
    `DecodeOutputs`: steps counts plan steps, commit_iteration the plan step
    whose cycle committed each offset, commit_phase PHASE_VERIFY / PHASE_INFILL.
  """
  model = nnx.merge(graphdef, params)
  batch, width = prompt_tokens.shape
  G, N = settings.gen_length, settings.slots_per_block
  chex.assert_shape(prompt_lengths, (batch,))
  _, cache = prefill(model, prompt_tokens, prompt_lengths, width + G)

  none = jnp.full((batch, G), -1, jnp.int32)
  state = _RowState(
    cache=cache,
    stage=jnp.full((batch,), STAGE_PLAN, jnp.int32),
    block=jnp.zeros((batch,), jnp.int32),
    undecided=jnp.ones((batch, N), bool),
    chosen=jnp.zeros((batch, N), bool),
    accepted=jnp.zeros((batch, N), jnp.int32),
    drafts=jnp.zeros((batch, settings.block_length), jnp.int32),
    eos_seen=jnp.zeros((batch,), bool),
    finished=jnp.zeros((batch,), bool),
    out=DecodeOutputs(
      answer=none,
      commit_iteration=none,
      commit_phase=jnp.full((batch, G), PHASE_NONE, jnp.int32),
      # The prompt prefill is a forward too; counting it keeps TPF
      # comparable with the AR baseline, whose prefill yields its first token.
      num_forwards=jnp.ones((batch,), jnp.int32),
      steps=jnp.zeros((batch,), jnp.int32),
    ),
  )
  state = row_sharded_while_loop(
    lambda s: ~jnp.all(s.finished),
    lambda s: _step(model, s, prompt_lengths, knobs, settings),
    state,
  )
  return state.out


def generate(
  model: Transformer,
  prompt_ids: Sequence[Sequence[int]],
  *,
  gen_length: int,
  slot_size: int,
  serial_blocks: int,
  slot_threshold: float,
  token_threshold: float,
  temperature: float = 0.0,
  seed: int = 0,
  mask_id: int | None = None,
  eos_id: int | None = None,
  pad_id: int | None = None,
  mesh: jax.sharding.Mesh | None = None,
) -> DecodeResult:
  """Batched ReFusion plan-and-infill decoding (docs/method.md §2), one compiled loop.

  Temperature > 0 samples the plan step by Gumbel-max (row b, plan step s
  draws its noise from fold_in(fold_in(key(seed), b), s), so results are
  reproducible per seed); slot confidence stays the un-noised probability of
  the drafted first token. Infill drafts are always argmax: docs/method.md §2 noises
  only the plan.

  Args:
    prompt_ids: B prompts of token ids, any lengths (padded into one bucket).
    gen_length: G, a multiple of slot_size × serial_blocks.
    slot_size: S, tokens per slot.
    serial_blocks: NB, blocks of G / NB tokens decoded left to right.
    slot_threshold: a slot is chosen when its confidence is > this.
    token_threshold: a drafted token passes verification when its AR probability is > this.
    mask_id, eos_id: default to the model config's; pad_id defaults to the
      config's pad, else its EOS, else 0 (padding is never attended).
    mesh: decode on this mesh (`refusion_jax.make_mesh`): rows split over its
      batch-parallel axes, parameters and cache by their logical axes.

  Returns:
    A `DecodeResult`. num_forwards counts the prompt prefill and every plan,
    verification, infill draft and infill verify pass; steps counts plans;
    commit_iteration is the plan step whose cycle committed each answer
    position and commit_phase PHASE_VERIFY or PHASE_INFILL (-1 / PHASE_NONE
    past the answer, also where a slot after the EOS was committed).
  """
  checked = check_refusion_knobs(
    model.config, gen_length, slot_size, serial_blocks, slot_threshold, token_threshold, temperature, mask_id, eos_id
  )
  knobs = DecodeKnobs(
    slot_threshold=jnp.float32(checked.slot_threshold),
    token_threshold=jnp.float32(checked.token_threshold),
    temperature=jnp.float32(checked.temperature),
    key=jax.random.key(seed),
    mask_id=jnp.int32(checked.mask_id),
    eos_id=jnp.int32(checked.eos_id),
  )
  settings = DecodeSettings(gen_length, slot_size, serial_blocks, sample=checked.temperature > 0)
  loop = functools.partial(decode_loop, knobs=knobs, settings=settings)
  return run_decoder(model, prompt_ids, loop, gen_length=gen_length, eos_id=checked.eos_id, pad_id=pad_id, mesh=mesh)
