"""ReFusion's scheduler: which rows and columns each forward runs, and at which compiled shape (docs/method.md §3.2).

Only a stage's active slots matter to a forward (`refusion` module docstring),
so each forward runs only as wide as the work: per iteration the scheduler
picks one of a few compiled (rows, width) shapes (`forward_shapes`), takes the
rows it serves, moves their active tokens into the leading columns (compact
order), runs the model, reads the token scores the stage logic needs
(`TokenScores`) and puts them back in block order, and lists the forward's keys
and values for the cache to stage. Rows left out wait for a later iteration:
their decode is unchanged, since a row's state moves only with its own
forwards.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp

from refusion_jax.decoding.scoring import (
  SamplingRule,
  draw,
  filter_floor,
  first_argmax,
  log_partition,
  policy_logprobs,
  token_logprobs,
  token_probs,
)
from refusion_jax.model import cache as kv_cache
from refusion_jax.model.transformer import Transformer

# Token budget of a width-fitted forward, in slots per row kept busy: each compiled (rows, width) shape
# holds max(T, ROW_BUDGET_SLOTS × K × S) tokens (`forward_shapes`). How it was chosen, with the numbers
# measured: README.md, "Benchmarks".
ROW_BUDGET_SLOTS = 2
# What a forward costs regardless of its size, in tokens of forward width: the scheduler divides the work a
# shape would serve by its tokens plus this (`scheduled_forward`). How it was fitted: README.md, "Benchmarks".
FORWARD_OVERHEAD_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class ForwardLayout:
  """What the scheduler needs of a ReFusion decode (static, hashable): the block it fits forwards into.

  Attributes:
    slot_size: S, tokens per slot (the narrowest width).
    block_length: T, tokens per serial block (the widest).
    fit_width: forwards only as wide as the active slots (False: always the whole block, one compiled width).
    pick_rows: narrow forwards may take fewer rows than K (False on a TPU and where rows are split over
      devices: the engine decides, `mesh.pick_rows_on`).
  """

  slot_size: int
  block_length: int
  fit_width: bool = True
  pick_rows: bool = True

  @property
  def widths(self) -> tuple[int, ...]:
    """The compiled query widths: S, 2S, 4S, ... below T, then T (only T without fit_width)."""
    width, widths = self.slot_size, []
    while self.fit_width and width < self.block_length:
      widths.append(width)
      width *= 2
    return (*widths, self.block_length)


@flax.struct.dataclass
class TokenScores:
  """What the stage logic reads from a forward, per block token [B, T] (junk on inactive tokens).

  greedy:          argmax of the logits (the threshold rule's infill drafts)
  greedy_logprob:  its log-probability under the model's softmax (log of the largest probability)
  planned:         the draw at t from the logits at t (`scoring.draw`: argmax plus Gumbel noise when sampling)
  planned_prob:    the un-noised probability of `planned`
  planned_logprob: the log-probability of `planned` under what the row draws from (`scoring.policy_logprobs`)
  previous_prob:   the probability of the token fed at t under the logits at t - 1 (AR
                   verification; read only where t is not the first of its slot)
  next_draw:       the draw at t from the logits at t - 1 with t's noise (the speculative rule's AR sample;
                   None under the threshold rule)
  next_logprob:    its log-probability under what the row draws from (None under the threshold rule)
  """

  greedy: jax.Array
  greedy_logprob: jax.Array
  planned: jax.Array
  planned_prob: jax.Array
  planned_logprob: jax.Array
  previous_prob: jax.Array
  next_draw: jax.Array | None = None
  next_logprob: jax.Array | None = None


def _gather_columns(x: jax.Array, columns: jax.Array, axis: int, batch_axis: int = 0) -> jax.Array:
  """x[..., columns[b, j], ...] along `axis`, for each b along `batch_axis`; columns: [B, W]."""
  shape = [1] * x.ndim
  shape[batch_axis], shape[axis] = columns.shape
  return jnp.take_along_axis(x, columns.reshape(shape), axis=axis)


def _after_first(first: jax.Array, rest: jax.Array) -> jax.Array:
  """[B, 1] and [B, W - 1] -> [B, W]: a read of t from the logits at t - 1, with `first` where there is none."""
  return jnp.concatenate([first, rest], axis=1)


def token_scores(
  logits: jax.Array, tokens: jax.Array, noise: jax.Array | None, rule: SamplingRule, next_draws: bool = False
) -> TokenScores:
  """The per-token reads of the stage logic from logits [B, W, vocab] of the fed tokens [B, W].

  Args:
    noise: [B, W, vocab] the temperature-scaled Gumbel noise of each token (None: greedy).
    rule: each row's `SamplingRule` ([B] fields).
    next_draws: also draw each token from its predecessor's logits (the speculative rule, static).
  """
  log_z = log_partition(logits)  # probabilities of given tokens only, never [B, W, vocab] (docs/method.md §3)
  greedy = first_argmax(logits)
  greedy_logprob = token_logprobs(logits, log_z, greedy)
  previous = token_probs(logits[:, :-1], log_z[:, :-1], tokens[:, 1:])
  if noise is None:  # every row greedy: the plan's draw is the argmax, under the model's own softmax
    floor, planned, planned_logprob = None, greedy, greedy_logprob
  else:
    floor = filter_floor(logits, rule)
    planned = draw(logits, noise, rule, floor)
    planned_logprob = policy_logprobs(logits, planned, rule, floor)
  scores = TokenScores(
    greedy=greedy,
    greedy_logprob=greedy_logprob,
    planned=planned,
    planned_prob=token_probs(logits, log_z, planned),
    planned_logprob=planned_logprob,
    previous_prob=_after_first(jnp.ones_like(previous[:, :1]), previous),
  )
  if not next_draws:
    return scores
  if noise is None:  # greedy: the draw from t - 1's logits is its argmax, read above
    following, following_logprob = greedy[:, :-1], greedy_logprob[:, :-1]
  else:
    before, before_floor = logits[:, :-1], floor[:, :-1]
    following = draw(before, noise[:, 1:], rule, before_floor)
    following_logprob = policy_logprobs(before, following, rule, before_floor)
  return scores.replace(
    next_draw=_after_first(planned[:, :1], following),
    next_logprob=_after_first(scores.planned_logprob[:, :1], following_logprob),
  )


def forward_shapes(layout: ForwardLayout, rows: int) -> tuple[tuple[int, int], ...]:
  """(rows, width) of each compiled forward over K = `rows` resident rows.

  Widths S, 2S, 4S, ... T, each with as many rows as a budget of
  max(T, ROW_BUDGET_SLOTS·K·S) tokens holds: a forward costs about its tokens
  on a CPU, so every shape costs about the same and narrow work is done for
  many rows at once. Without fit_width: one shape, every row at the whole block. Without pick_rows: every
  width over all K rows.
  """
  if not layout.fit_width:
    return ((rows, layout.block_length),)
  if not layout.pick_rows:
    return tuple((rows, width) for width in layout.widths)
  budget = max(layout.block_length, ROW_BUDGET_SLOTS * rows * layout.slot_size)
  return tuple((min(rows, budget // width), width) for width in layout.widths)


def _take_rows(tree, rows: jax.Array | None, axis: int = 0):
  """Every leaf's entries `rows` along `axis` (all of them when rows is None)."""
  return tree if rows is None else jax.tree.map(lambda x: jnp.take(x, rows, axis=axis), tree)


def _put_rows(batch: int, part: jax.Array, rows: jax.Array | None) -> jax.Array:
  """`part` scattered at `rows` into zeros with `batch` leading entries (`part` when rows is None)."""
  if rows is None:
    return part
  return jnp.zeros((batch, *part.shape[1:]), part.dtype).at[rows].set(part)


def _leading(priority: jax.Array, count: int) -> jax.Array:
  """The indices of the `count` largest of priority [K], largest first, ties to the lower index.

  What a stable descending argsort's first `count` entries are, from pairwise
  comparisons: XLA's CPU sort costs several microseconds per call even on a
  handful of rows, and the scheduler asks once per shape every iteration.
  """
  index = jnp.arange(priority.shape[0])
  ahead = (priority[None, :] > priority[:, None]) | (
    (priority[None, :] == priority[:, None]) & (index < index[:, None])
  )
  rank = jnp.sum(ahead, axis=1)  # rank[i]: the rows ahead of row i
  return jnp.sum(jnp.where(rank[None, :] == jnp.arange(count)[:, None], index[None, :], 0), axis=1)


def _compact_order(active: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The stable partition of the block columns, active ones first: order [B, T] (compact column -> block
  column) and its inverse back [B, T] (block column -> compact column), from cumulative sums, not sorts."""
  length = active.shape[-1]
  back = jnp.where(
    active,
    jnp.cumsum(active, axis=-1) - 1,
    jnp.sum(active, axis=-1, keepdims=True) + jnp.cumsum(~active, axis=-1) - 1,
  )
  at = back[:, None, :] == jnp.arange(length)[None, :, None]  # [B, compact, block]
  order = jnp.sum(jnp.where(at, jnp.arange(length), 0), axis=-1)
  return order, back


def _token_list(x: jax.Array, axis: int, size: int, fill: int = 0) -> jax.Array:
  """x with its (rows, width) axes `axis`, `axis` + 1 merged into one of `size` tokens, padded with `fill`."""
  merged = x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])
  padding = [(0, 0)] * merged.ndim
  padding[axis] = (0, size - merged.shape[axis])
  return jnp.pad(merged, padding, constant_values=fill)


@flax.struct.dataclass
class BlockQuery:
  """What every row would feed a forward, in block layout (K rows, T block tokens).

  tokens:    [K, T] int32 query tokens
  positions: [K, T] int32 their true positions
  sees:      [K, T, T] bool which block tokens each query token sees
  active:    [K, T] bool the tokens whose outputs matter (whole slots)
  noise:     [K, T, vocab] temperature-scaled Gumbel noise of each token's draw, or None (greedy)
  rule:      each row's `scoring.SamplingRule` ([K] fields)
  """

  tokens: jax.Array
  positions: jax.Array
  sees: jax.Array
  active: jax.Array
  noise: jax.Array | None
  rule: SamplingRule


def _choose_shape(
  shapes: tuple[tuple[int, int], ...], query: BlockQuery, waited: jax.Array, live: jax.Array
) -> tuple[jax.Array, tuple[jax.Array | None, ...], jax.Array]:
  """The shape to run: each is scored by the work it would do, each live row's active tokens plus the
  iterations it has waited, summed over the rows it would take (those whose active tokens fit its width,
  most work first), per cost (its tokens plus FORWARD_OVERHEAD_TOKENS); ties go to the narrower shape.

  Returns:
    the index of the best shape [], each shape's rows (None: all K) and served [shapes, K] bool: the rows
    each shape would run.
  """
  batch = live.shape[0]
  need = jnp.sum(query.active, axis=-1)
  priority = jnp.where(live, need + waited, -1)
  picks, served, work = [], [], []
  for rows, width in shapes:
    fits = live & (need <= width)
    pick = None if rows == batch else _leading(jnp.where(fits, priority, -1), rows)
    taken = fits if pick is None else jnp.zeros((batch,), bool).at[pick].set(fits[pick])
    picks.append(pick)
    served.append(taken)
    work.append(jnp.sum(jnp.where(taken, priority, 0)) / (rows * width + FORWARD_OVERHEAD_TOKENS))
  return jnp.argmax(jnp.stack(work)), tuple(picks), jnp.stack(served)


def _run_shape(
  model: Transformer,
  index: int,
  width: int,
  tokens_out: int,
  next_draws: bool,
  query: BlockQuery,
  order: jax.Array,
  back: jax.Array,
  picks: tuple[jax.Array | None, ...],
  cache: kv_cache.KVCache,
) -> tuple[TokenScores, tuple[jax.Array, ...]]:
  """One branch of the scheduler's switch: the forward of shape `index` (its rows, `width` compact columns).

  Returns:
    `TokenScores` [K, T] in block order (zeros for rows not taken) and the forward's tokens as one list
    of `tokens_out` entries for `kv_cache.stage`: (k, v, row, offset, position); unused entries point past
    the cache. The list has the same size in every branch, so the cache is written once, outside the
    switch, in place (a branch writing it would have to copy it).
  """
  batch = query.tokens.shape[0]
  pick = picks[index]
  rows = functools.partial(_take_rows, rows=pick)
  columns = rows(order)[:, :width]
  fed = _gather_columns(rows(query.tokens), columns, 1)
  fed_positions = _gather_columns(rows(query.positions), columns, 1)
  block_sees = _gather_columns(_gather_columns(rows(query.sees), columns, 1), columns, 2)
  rows_cache = cache if pick is None else cache.take_rows(pick)
  logits, kv = model(fed, fed_positions, kv_cache.block_mask(rows_cache, block_sees), rows_cache)
  noise = None if query.noise is None else _gather_columns(rows(query.noise), columns, 1)
  to_block = jnp.minimum(rows(back), width - 1)
  scores = jax.tree.map(
    lambda x: _put_rows(batch, _gather_columns(x, to_block, 1), pick),
    token_scores(logits, fed, noise, rows(query.rule), next_draws),
  )
  token_rows = jnp.broadcast_to((jnp.arange(batch) if pick is None else pick)[:, None], fed.shape)
  offsets = jnp.broadcast_to(jnp.arange(width), fed.shape)
  listed = lambda x, axis=0, fill=0: _token_list(x, axis, tokens_out, fill)
  staged = (
    listed(kv.k, 1),
    listed(kv.v, 1),
    listed(token_rows),
    listed(offsets, fill=cache.capacity),
    listed(fed_positions),
  )
  return scores, staged


def scheduled_forward(
  model: Transformer,
  cache: kv_cache.KVCache,
  waited: jax.Array,
  query: BlockQuery,
  live: jax.Array,
  layout: ForwardLayout,
  next_draws: bool = False,
) -> tuple[TokenScores, kv_cache.KVCache, jax.Array, jax.Array]:
  """One forward of the rows and columns that fit the best compiled (rows, width) shape (`_choose_shape`).

  In a forward, each row's active tokens (whole slots, stable-sorted into the
  leading columns) see only active tokens, so dropping the others changes no
  active output, and a token's predecessor in its slot stays its left
  neighbour.

  Args:
    waited: [K] int32 iterations each row has waited for a forward.
    live: [K] bool the rows decoding.
    next_draws: also draw each token from its predecessor's logits (`token_scores`; static).

  Returns:
    `TokenScores` [K, T] in block order (junk on inactive tokens and left-out
    rows); the cache with the forward's keys and values staged after each row's
    entries (`kv_cache.stage`), compact column j right after the row's last
    entry (junk past its active tokens: a commit keeps a prefix of the active
    tokens, which compact order keeps in block order, so nothing is moved
    back); served [K] bool (the rows that ran) and the query width that ran
    [] int32.
  """
  shapes = forward_shapes(layout, live.shape[0])
  shape_index, picks, served = _choose_shape(shapes, query, waited, live)
  order, back = _compact_order(query.active)
  tokens_out = max(rows * width for rows, width in shapes)
  branches = [
    functools.partial(_run_shape, model, i, width, tokens_out, next_draws) for i, (_, width) in enumerate(shapes)
  ]
  scores, staged = jax.lax.switch(shape_index, branches, query, order, back, picks, cache)
  width = jnp.asarray([width for _, width in shapes], jnp.int32)[shape_index]
  return scores, kv_cache.stage(cache, *staged), served[shape_index], width
