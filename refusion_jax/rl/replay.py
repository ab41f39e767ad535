"""The exact log-probability of each token of a rollout, replayed in one teacher-forced forward (docs/rl.md §2).

A rollout of speculative ReFusion (`rj.ReFusion(acceptance="speculative")`, docs/method.md §6) commits whole
slots, cycle after cycle, and every committed token is a draw from a distribution the decoder names: a slot's
first token from the PLAN forward of its cycle (mask ids at the block's then-undecided slots, seeing the prompt
and everything committed before the cycle), each further token from the AR distribution given that same context
and the slot's earlier tokens (not the other slots committed in the same cycle, which were drawn in separate
rows). The decoder records each token's cycle (`Rollout.iteration`), so those contexts can be rebuilt all at
once: `trajectory_logprobs` lays one answer out as

    [prompt][committed tokens in commit order][one masked tail per cycle]

with every token at its true position (prompt length + answer position; RoPE reads positions, the attention
mask says who sees whom) and a [length, length] mask under which

- a committed token sees the prompt, the tokens committed in earlier cycles, and its own slot's earlier tokens;
- the tail of cycle c (mask ids at its block's undecided positions, up to the last first token it committed)
  sees the prompt, the tokens committed before c, and the tail's earlier masks (causal);

so a slot's first token reads its log-probability from its mask's logits in its cycle's tail, and each later
token from its predecessor's logits (the AR shift). For the AR baseline the layout is the plain causal
[prompt][answer] with the shift. Every log-probability is under the distribution the decoder drew from:
softmax(filtered(logits / T)), or the model's own log-softmax at T = 0 (`refusion_jax.decoding.scoring`,
the decoder's own functions).

The forward is differentiable in the model's parameters (the GRPO ratio's numerator), jit-able (shapes are
static: rows, prompt width, G and the tail budget), runs under the training mesh (rows over the data axes; the
layout's arrays are constrained like the batch), and never builds [rows, length, vocab] logits: the hidden
states of the G predicting tokens are gathered and read `chunk` answer tokens at a time
(`refusion_jax.training.cross_entropy.chunked_per_token`, the chunked loss's machinery).

Names: the issue's `trajectory_logprobs(model, prompt_ids, result)` takes the prompts' true lengths and the
`Rollout` (not the whole `DecodeResult`, which is host-only), and the method value that produced it.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from refusion_jax.decoding.checks import check_special_id
from refusion_jax.decoding.scoring import SamplingRule, filter_floor, policy_logprobs
from refusion_jax.model.transformer import Transformer
from refusion_jax.parallel.activations import constrain
from refusion_jax.training.cross_entropy import chunked_per_token

__all__ = [
  "ReplayLayout",
  "Trajectory",
  "ar_layout",
  "max_tail_length",
  "refusion_layout",
  "tail_length_needed",
  "trajectory_logprobs",
]

# A key "committed" at this cycle is seen by no query (tails, padding).
_NEVER = np.iinfo(np.int32).max // 2

_ROWS = ("activation_batch", "activation_length")


@flax.struct.dataclass
class Trajectory:
  """What a replay reads of a rollout, all [rows, G] (`refusion_jax.decoding.result.Rollout` holds the same):

  tokens:    int32 the committed token at each answer position, -1 where none was committed
  iteration: int32 the cycle (plan step, 0-based over all blocks) that committed it, -1 where none

  A pytree, so that a jitted replay takes it as an argument: `Trajectory(rollout.tokens, rollout.iteration)`.
  """

  tokens: jax.Array
  iteration: jax.Array


@flax.struct.dataclass
class ReplayLayout:
  """One teacher-forced forward per answer, L = prompt width + G + tail tokens.

  tokens:     [B, L] int32 fed ids (0 on padding)
  positions:  [B, L] int32 true RoPE positions
  query_time: [B, L] int32 a token sees the keys whose `key_time` is below its own ...
  key_time:   [B, L] int32 ... (prompt -1, a committed token its cycle, tails and padding never)
  group:      [B, L] int32 ... and the earlier tokens of its own group (the prompt, one committed slot, one tail;
              padding: a group of its own)
  predictor:  [B, G] int32 the index whose logits give each answer position's log-probability
  scored:     [B, G] bool committed positions whose predictor lies in the layout
  """

  tokens: jax.Array
  positions: jax.Array
  query_time: jax.Array
  key_time: jax.Array
  group: jax.Array
  predictor: jax.Array
  scored: jax.Array

  @property
  def sees(self) -> jax.Array:
    """[B, L, L] bool: entry [b, i, j] says whether token i sees token j."""
    length = self.tokens.shape[1]
    earlier = jnp.tril(jnp.ones((length, length), bool))[None]
    same_group = self.group[:, :, None] == self.group[:, None, :]
    before = self.key_time[:, None, :] < self.query_time[:, :, None]
    return constrain(before | (same_group & earlier), (*_ROWS, None))


def _prompt_start(prompt_ids: jax.Array, prompt_lengths: jax.Array, left_padded: bool) -> jax.Array:
  """[B] the column of each prompt's first token."""
  return prompt_ids.shape[1] - prompt_lengths if left_padded else jnp.zeros_like(prompt_lengths)


def _prompt_part(prompt_ids: jax.Array, prompt_lengths: jax.Array, left_padded: bool) -> tuple[jax.Array, ...]:
  """tokens, positions, query_time, key_time, group [B, P] of the padded prompts."""
  batch, width = prompt_ids.shape
  index = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
  start = _prompt_start(prompt_ids, prompt_lengths, left_padded)[:, None]
  valid = (index >= start) & (index < start + prompt_lengths[:, None])
  tokens = jnp.where(valid, prompt_ids, 0)
  positions = jnp.maximum(index - start, 0)
  return tokens, positions, jnp.full_like(index, -1), jnp.where(valid, -1, _NEVER), jnp.where(valid, 0, -1 - index)


def _join(*parts: tuple[jax.Array, ...], predictor: jax.Array, scored: jax.Array) -> ReplayLayout:
  # Unscored positions read index 0: an index outside the layout would gather NaNs, whose zero cotangents
  # still make NaN gradients.
  predictor = jnp.where(scored, predictor, 0)
  fields = [constrain(jnp.concatenate(column, axis=1).astype(jnp.int32), _ROWS) for column in zip(*parts)]
  return ReplayLayout(*fields, predictor=predictor.astype(jnp.int32), scored=scored)


def ar_layout(
  prompt_ids: jax.Array, prompt_lengths: jax.Array, tokens: jax.Array, *, left_padded: bool = False
) -> ReplayLayout:
  """[prompt][answer], causal; answer token t read from the token before it (the prompt's last for t = 0).

  Args:
    prompt_ids: [B, P] padded prompts (on the right, or on the left with `left_padded`); prompt_lengths: [B]
      their true lengths.
    tokens: [B, G] the answers, -1 where nothing was committed.
  """
  batch, width = prompt_ids.shape
  gen_length = tokens.shape[1]
  committed = tokens >= 0
  step = jnp.broadcast_to(jnp.arange(gen_length, dtype=jnp.int32), tokens.shape)
  answer = (
    jnp.where(committed, tokens, 0),
    prompt_lengths[:, None] + step,
    step,
    jnp.where(committed, step, _NEVER),
    -1 - width - step,  # each token a group of its own: it sees the earlier ones by time
  )
  last = _prompt_start(prompt_ids, prompt_lengths, left_padded) + prompt_lengths - 1
  predictor = jnp.where(step == 0, last[:, None], width + step - 1)
  return _join(_prompt_part(prompt_ids, prompt_lengths, left_padded), answer, predictor=predictor, scored=committed)


def _tails(
  tokens: jax.Array, iteration: jax.Array, slot_size: int, block_length: int, eos_id: int | jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Which answer positions each cycle's tail holds, and where: in_tail [B, C, G] bool and their index in the
  tails [B, C, G] (C = G / S bounds the cycles: each commits at least one slot).

  The tail of cycle c holds, in block order, the positions of c's block whose slots were still undecided at c
  (not committed before c, and not dropped by an EOS committed before c in an earlier slot of the block), up to
  the last first token c committed: the masks after it change no log-probability.
  """
  gen_length = tokens.shape[1]
  cycles = gen_length // slot_size
  position = jnp.arange(gen_length, dtype=jnp.int32)
  slot, block, is_first = position // slot_size, position // block_length, position % slot_size == 0
  committed = iteration >= 0
  cycle = jnp.arange(cycles, dtype=jnp.int32)

  # Per cycle c: its block, and the last first token it committed ([B, C]).
  at_cycle = committed[:, None, :] & (iteration[:, None, :] == cycle[None, :, None])  # [B, C, G]
  cycle_block = jnp.max(jnp.where(at_cycle, block, -1), axis=-1)
  last_first = jnp.max(jnp.where(at_cycle & is_first, position, -1), axis=-1)
  # Per slot k: the last cycle it was undecided in: its commit cycle, or the first cycle that committed an EOS
  # in an earlier slot of its block (which dropped it) ([B, slots]).
  slot_index = jnp.arange(cycles, dtype=jnp.int32)
  eos = committed & (tokens == eos_id)
  drops = eos[:, None, :] & (slot[None, None, :] < slot_index[None, :, None])
  drops &= block[None, None, :] == (slot_index * slot_size // block_length)[None, :, None]
  dropped_at = jnp.min(jnp.where(drops, iteration[:, None, :], _NEVER), axis=-1)
  slot_cycle = iteration[:, ::slot_size]
  last_undecided = jnp.where(slot_cycle >= 0, slot_cycle, dropped_at)

  in_tail = (cycle_block[:, :, None] == block[None, None, :]) & (position[None, None, :] <= last_first[:, :, None])
  in_tail &= cycle[None, :, None] <= last_undecided[:, None, :][..., slot]
  tail_count = jnp.sum(in_tail, axis=-1, dtype=jnp.int32)
  tail_start = jnp.cumsum(tail_count, axis=-1) - tail_count
  return in_tail, tail_start[:, :, None] + jnp.cumsum(in_tail, axis=-1, dtype=jnp.int32) - 1


def refusion_layout(
  prompt_ids: jax.Array,
  prompt_lengths: jax.Array,
  tokens: jax.Array,
  iteration: jax.Array,
  *,
  slot_size: int,
  block_length: int,
  tail_length: int,
  mask_id: int | jax.Array,
  eos_id: int | jax.Array,
  left_padded: bool = False,
) -> ReplayLayout:
  """[prompt][committed slots in commit order][one masked tail per cycle] of speculative ReFusion rollouts.

  Args:
    prompt_ids: [B, P] padded prompts (on the right, or on the left with `left_padded`); prompt_lengths: [B]
      their true lengths.
    tokens, iteration: [B, G] the rollout (`Trajectory`).
    slot_size, block_length: S and T = G / serial_blocks.
    tail_length: R, the tail tokens the layout holds (`tail_length_needed`, `max_tail_length`); first tokens
      whose mask falls past it are not scored.
    mask_id, eos_id: the decode's special ids.
  """
  batch, width = prompt_ids.shape
  gen_length = tokens.shape[1]
  cycles = gen_length // slot_size
  position = jnp.arange(gen_length, dtype=jnp.int32)
  is_first = position % slot_size == 0
  committed = iteration >= 0
  cycle = jnp.arange(cycles, dtype=jnp.int32)
  in_tail, tail_index = _tails(tokens, iteration, slot_size, block_length, eos_id)
  destination = jnp.where(in_tail, tail_index, tail_length).reshape(batch, -1)  # past the tail: dropped
  rows = jnp.arange(batch)[:, None]

  def to_tail(values: jax.Array, empty: int) -> jax.Array:  # [B, C, G] -> [B, R]
    flat = jnp.broadcast_to(values, in_tail.shape).reshape(batch, -1)
    return jnp.full((batch, tail_length), empty, jnp.int32).at[rows, destination].set(flat, mode="drop")

  tail_position = to_tail(position[None, None, :], 0)
  tail_cycle = to_tail(cycle[None, :, None], -1)
  in_layout = tail_cycle >= 0
  tail_slot = jnp.arange(tail_length, dtype=jnp.int32)
  tail = (
    jnp.where(in_layout, mask_id, 0),
    prompt_lengths[:, None] + tail_position,
    tail_cycle,
    jnp.full_like(tail_cycle, _NEVER),
    jnp.where(in_layout, 1 + cycles + tail_cycle, -1 - width - gen_length - tail_slot),
  )

  # Commit order: by cycle, then by position (a slot's tokens in order); uncommitted positions last.
  order = jnp.argsort(jnp.where(committed, iteration, cycles) * gen_length + position, axis=-1)
  place = jnp.argsort(order, axis=-1)  # each position's index in commit order
  ordered = lambda x: jnp.take_along_axis(x, order, axis=-1)
  ordered_committed = ordered(committed)
  answer = (
    ordered(jnp.where(committed, tokens, 0)),
    prompt_lengths[:, None] + order,
    ordered(iteration),
    ordered(jnp.where(committed, iteration, _NEVER)),
    jnp.where(ordered_committed, 1 + order // slot_size, -1 - width - jnp.arange(gen_length)),
  )

  # A first token reads its mask's logits in its cycle's tail; the others their predecessor's in the slot.
  own_cycle = jnp.clip(iteration, 0, cycles - 1)[:, None, :]
  first_in_tail = jnp.take_along_axis(tail_index, own_cycle, axis=1)[:, 0, :]
  previous = width + jnp.roll(place, 1, axis=-1)
  predictor = jnp.where(is_first, width + gen_length + first_in_tail, previous)
  scored = committed & (~is_first | (first_in_tail < tail_length))
  prompt = _prompt_part(prompt_ids, prompt_lengths, left_padded)
  layout = _join(prompt, answer, tail, predictor=predictor, scored=scored)
  return layout


def max_tail_length(method) -> int:
  """The tail tokens any rollout of `method` can need: a block of N slots of S tokens whose cycles each
  commit only its last undecided slot needs S·N(N-1)/2 + N."""
  if _kind(method) == "ar":
    return 0
  slots = method.gen_length // method.serial_blocks // method.slot_size
  return method.serial_blocks * (method.slot_size * slots * (slots - 1) // 2 + slots)


def tail_length_needed(rollout: Trajectory, method, *, eos_id: int) -> int:
  """The tail tokens this batch of rollouts needs (read on the host), to size `tail_length`: a static shape, so
  round it up to a few buckets to bound recompilations."""
  if _kind(method) == "ar":
    return 0
  tokens, iteration = (np.asarray(x, np.int32) for x in (rollout.tokens, rollout.iteration))
  in_tail, _ = _tails(tokens, iteration, method.slot_size, method.gen_length // method.serial_blocks, eos_id)
  return int(np.asarray(in_tail).sum(axis=(1, 2)).max(initial=0))


def _kind(method) -> str:
  """ "ar" or "refusion" (speculative), or a clear refusal for a method whose tokens are not draws of a policy
  with exact probabilities."""
  name = getattr(method, "name", None)
  if name == "ar":
    return "ar"
  if name == "refusion":
    if getattr(method, "acceptance", "threshold") != "speculative":
      raise ValueError(
        f"{method!r} decodes by the threshold rule, whose drafts are not draws of a policy with exact "
        'probabilities; replay rollouts of rj.ReFusion(..., acceptance="speculative") (docs/rl.md §1).'
      )
    return "refusion"
  raise ValueError(
    f"Replay knows rj.AR and speculative rj.ReFusion rollouts, not {method!r}: an MDM step attends both ways, "
    "so no single causal forward gives its tokens' probabilities."
  )


def _per_row(value, batch: int, dtype) -> jax.Array:
  return jnp.broadcast_to(jnp.asarray(value, dtype), (batch,))


def trajectory_logprobs(
  model: Transformer,
  prompt_ids: jax.Array,
  prompt_lengths: jax.Array,
  rollout: Trajectory,
  method,
  *,
  temperature: float | jax.Array,
  top_k: int | jax.Array = 0,
  top_p: float | jax.Array = 1.0,
  min_p: float | jax.Array = 0.0,
  mask_id: int | None = None,
  eos_id: int | None = None,
  tail_length: int | None = None,
  chunk: int = 256,
  prompt_padding: str = "right",
  dropout_key: jax.Array | None = None,
) -> jax.Array:
  """[B, G] float32: each committed token's log-probability under the policy that drew it, NaN elsewhere.

  Equal to the decoder's own record (`DecodeResult.rollout.logprobs`) up to float rounding; differentiable in
  the model's parameters. Jit it with `method`, `tail_length` and `chunk` static (and the ids, when given):
  `nnx.jit(trajectory_logprobs, static_argnames=("method", "tail_length", "chunk", "mask_id", "eos_id"))`.

  Args:
    model: the policy (training view or inference view: the same function).
    prompt_ids: [B, P] padded prompt ids; prompt_lengths: [B] true lengths.
    rollout: the rollout's tokens and cycles ([B, G] each, `Trajectory`; `DecodeResult.rollout`).
    method: the method value that decoded it: `rj.AR(...)` or `rj.ReFusion(..., acceptance="speculative")`
      (G, S and serial_blocks are read from it).
    temperature, top_k, top_p, min_p: what the rollout sampled with, per row ([B]) or for all
      (`scoring.SamplingRule`; temperature 0: greedy, read under the model's own softmax).
    mask_id, eos_id: the decode's ids (default: the model config's).
    tail_length: the tail tokens of the layout (default: `max_tail_length(method)`, always enough; a smaller
      one from `tail_length_needed` makes the forward shorter; a first token whose mask does not fit is NaN).
    chunk: answer tokens whose logits exist at once (`chunked_per_token`); <= 0: all at once.
    prompt_padding: "right" (the decoder's `pad_prompts`) or "left": where each prompt's padding is.
    dropout_key: the LoRA adapters' dropout (training); None: none.
  """
  kind = _kind(method)
  if prompt_padding not in ("right", "left"):
    raise ValueError(f'prompt_padding={prompt_padding!r}; say where the prompts are padded: "right" or "left".')
  left_padded = prompt_padding == "left"
  tokens, iteration = jnp.asarray(rollout.tokens, jnp.int32), jnp.asarray(rollout.iteration, jnp.int32)
  prompt_ids, prompt_lengths = jnp.asarray(prompt_ids, jnp.int32), jnp.asarray(prompt_lengths, jnp.int32)
  batch, gen_length = tokens.shape
  if gen_length != method.gen_length or prompt_ids.shape[0] != batch:
    raise ValueError(
      f"The rollout holds {tokens.shape} tokens and the prompts are {prompt_ids.shape}: expected [rows, "
      f"G = {method.gen_length}] (the method's gen_length) and one prompt per rollout row."
    )
  if kind == "ar":
    layout = ar_layout(prompt_ids, prompt_lengths, tokens, left_padded=left_padded)
  else:
    config = model.config
    layout = refusion_layout(
      prompt_ids,
      prompt_lengths,
      tokens,
      iteration,
      slot_size=method.slot_size,
      block_length=method.gen_length // method.serial_blocks,
      tail_length=max_tail_length(method) if tail_length is None else int(tail_length),
      mask_id=check_special_id("mask_id", config.mask_token_id if mask_id is None else mask_id, config),
      eos_id=check_special_id("eos_id", config.eos_token_id if eos_id is None else eos_id, config),
      left_padded=left_padded,
    )
  rule = SamplingRule(
    temperature=_per_row(temperature, batch, jnp.float32),
    top_k=_per_row(top_k, batch, jnp.int32),
    top_p=_per_row(top_p, batch, jnp.float32),
    min_p=_per_row(min_p, batch, jnp.float32),
  )
  hidden, _ = model.features(layout.tokens, layout.positions, layout.sees, dropout_key=dropout_key)
  predicting = jnp.take_along_axis(hidden, layout.predictor[..., None], axis=1)  # [B, G, embed]
  predicting = constrain(predicting, (*_ROWS, "activation_embed"))
  read = functools.partial(_policy_logprobs, model, rule)
  logprobs = chunked_per_token(read, predicting, jnp.where(layout.scored, tokens, 0), chunk=chunk)
  return jnp.where(layout.scored, logprobs, jnp.nan)


def _policy_logprobs(model: Transformer, rule: SamplingRule, hidden: jax.Array, tokens: jax.Array) -> jax.Array:
  """[B, n] log-probabilities of tokens [B, n] under what each row draws from, given hidden [B, n, embed]."""
  logits = model.logits(hidden)
  floor = jax.lax.stop_gradient(filter_floor(logits, rule))  # which tokens a filter keeps is not differentiated
  return policy_logprobs(logits, tokens, rule, floor)
