"""Continuous batching inside the compiled decode loop: K rows kept busy over a queue of Q prompts.

Every jitted decoder (ReFusion, AR, MDM) carries a `Batch`: K *rows*, each
decoding one prompt of a queue, and the outputs of every queued prompt. Each
loop iteration first admits queued prompts into idle rows (the decoder's
`admit`: a prefill into that row), then runs one decode step for all rows
(the decoder's `step`), whose finished rows turn idle. A static batch is the
case K = Q. Results are written by queue index, so they come back in input
order whatever row decoded them, and a row's decode never depends on the
other rows (docs/method.md §3), so each prompt gets its B = 1 decode.

`run_rows` stops after `max_iterations` iterations or when nothing is left to
do, and returns the `Batch`: a server drives a decoder's loop in chunks (state
in, state out) and never recompiles, since the shapes stay fixed. On a mesh
(`refusion_jax.decoding.sharding.sharded_loop`) rows and queued prompts are
split over the batch-parallel axes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from refusion_jax.decoding.sharding import constrain_rows
from refusion_jax.model.cache import KVCache

# How each answer offset was committed (`DecodeOutputs.commit_phase`, `DecodeResult.commit_phase`).
PHASE_NONE = -1
PHASE_VERIFY = 0  # committed as a whole slot by the global verification (docs/method.md §2 step 2)
PHASE_INFILL = 1  # committed after parallel infill (step 3)
PHASE_STEP = 2  # baselines: committed by an AR step or an MDM unmasking step


@flax.struct.dataclass
class DecodeOutputs:
  """What a decode loop writes, per queued prompt (Q of them).

  answer:           [Q, G] int32 ids by answer offset (anything where none was committed)
  commit_iteration: [Q, G] int32 iteration (0-based) that committed each offset, -1 where none
  commit_phase:     [Q, G] int32 PHASE_* of each offset, PHASE_NONE where none
  num_forwards:     [Q] int32 forwards the prompt's row took part in (its prefill included)
  steps:            [Q] int32 decode iterations of the prompt
  """

  answer: jax.Array
  commit_iteration: jax.Array
  commit_phase: jax.Array
  num_forwards: jax.Array
  steps: jax.Array

  @classmethod
  def empty(cls, queue: int, gen_length: int) -> DecodeOutputs:
    """Nothing committed yet (host arrays: starting a batch dispatches no device work)."""
    none = np.full((queue, gen_length), -1, np.int32)
    zeros = np.zeros((queue,), np.int32)
    return cls(none, none, np.full((queue, gen_length), PHASE_NONE, np.int32), zeros, zeros)


@flax.struct.dataclass
class Batch:
  """The state a decode loop carries, and returns after each chunk.

  rows:          the decoder's per-row state (leading axis K; a `KVCache` in it has K on axis 1)
  prompt:        [K] int32 queue index of the prompt each row decodes (meaningful where busy)
  busy:          [K] bool the row is decoding
  queue_tokens:  [Q, P] int32 right-padded prompts (P = the prompt bucket)
  queue_lengths: [Q] int32 their true lengths
  queued:        int32 prompts 0 .. queued-1 are real (the rest pad Q to a bucket)
  admitted:      int32 prompts admitted so far (in queue order)
  out:           `DecodeOutputs` of every queued prompt
  widths:        [names, largest width + 1] int32 forwards counted by query width, one row per
                 name of the decoder's `width_names` (`DecodeResult.widths`)
  """

  rows: Any
  prompt: jax.Array
  busy: jax.Array
  queue_tokens: jax.Array
  queue_lengths: jax.Array
  queued: jax.Array
  admitted: jax.Array
  out: DecodeOutputs
  widths: jax.Array

  @classmethod
  def create(
    cls, rows: Any, widths: np.ndarray, tokens: np.ndarray, lengths: np.ndarray, queued: int, gen_length: int
  ) -> Batch:
    """K idle rows (K = the rows' leading size) before a queue of prompts [Q, P] with lengths [Q]."""
    batch = jax.tree.leaves(rows)[-1].shape[0]
    chex.assert_rank([tokens, lengths], [2, 1])
    chex.assert_type([tokens, lengths], int)
    return cls(
      rows=rows,
      prompt=np.zeros((batch,), np.int32),
      busy=np.zeros((batch,), bool),
      queue_tokens=np.asarray(tokens, np.int32),
      queue_lengths=np.asarray(lengths, np.int32),
      queued=np.int32(queued),
      admitted=np.int32(0),
      out=DecodeOutputs.empty(tokens.shape[0], gen_length),
      widths=widths,
    )

  def shardings(self, rows: Callable[[Any], Any], replicated: Any) -> Batch:
    """The Batch's shardings on a mesh: `rows(tree)` for the rows, queue and outputs, the counters replicated."""
    return self.replace(
      rows=rows(self.rows),
      prompt=rows(self.prompt),
      busy=rows(self.busy),
      queue_tokens=rows(self.queue_tokens),
      queue_lengths=rows(self.queue_lengths),
      queued=replicated,
      admitted=replicated,
      out=rows(self.out),
      widths=replicated,
    )

  @property
  def done(self) -> bool:
    """Every queued prompt has been admitted and decoded (reads two values back to the host)."""
    return int(self.admitted) == int(self.queued) and not bool(jnp.any(self.busy))


# admit(rows, out, row, index, tokens [P], length) -> (rows, out): start queued prompt `index` in row `row`.
Admit = Callable[[Any, DecodeOutputs, jax.Array, jax.Array, jax.Array, jax.Array], tuple[Any, DecodeOutputs]]
# step(rows, out, widths, live [K], index [K]) -> (rows, out, widths, finished [K]); index = Q on idle rows.
Step = Callable[[Any, DecodeOutputs, jax.Array, jax.Array, jax.Array], tuple[Any, DecodeOutputs, jax.Array, jax.Array]]


def run_rows(batch: Batch, max_iterations: jax.Array, admit: Admit, step: Step) -> Batch:
  """Admit and step until nothing is left to do or `max_iterations` steps ran (call under `jax.jit`)."""

  def can_admit(b: Batch) -> jax.Array:
    return jnp.any(~b.busy) & (b.admitted < b.queued)

  def admit_next(b: Batch) -> Batch:
    row, index = jnp.argmin(b.busy), b.admitted  # the first idle row takes the next prompt
    rows, out = admit(b.rows, b.out, row, index, b.queue_tokens[index], b.queue_lengths[index])
    return b.replace(
      rows=rows, out=out, prompt=b.prompt.at[row].set(index), busy=b.busy.at[row].set(True), admitted=index + 1
    )

  def body(carry: tuple[Batch, jax.Array]) -> tuple[Batch, jax.Array]:
    b, iteration = carry
    b = jax.lax.while_loop(can_admit, admit_next, b)
    index = jnp.where(b.busy, b.prompt, b.out.num_forwards.shape[0])
    rows, out, widths, finished = step(b.rows, b.out, b.widths, b.busy, index)
    return b.replace(rows=rows, out=out, widths=widths, busy=b.busy & ~finished), iteration + 1

  def cond(carry: tuple[Batch, jax.Array]) -> jax.Array:
    b, iteration = carry
    return (jnp.any(b.busy) | can_admit(b)) & (iteration < max_iterations)

  def pin(carry: tuple[Batch, jax.Array]) -> tuple[Batch, jax.Array]:
    # On a mesh the rows and the outputs keep their row sharding in every iteration (not left to propagation).
    b, iteration = carry
    return b.replace(rows=constrain_rows(b.rows), out=constrain_rows(b.out)), iteration

  batch, _ = jax.lax.while_loop(cond, lambda carry: pin(body(carry)), pin((batch, jnp.int32(0))))
  return batch


def put_row(full: Any, row: jax.Array, one: Any) -> Any:
  """`full` (leading axis K) with entry `row` replaced by the leading-size-1 `one` (same tree)."""
  return jax.tree.map(lambda f, o: jax.lax.dynamic_update_slice_in_dim(f, o.astype(f.dtype), row, axis=0), full, one)


def put_cache_row(cache: KVCache, row: jax.Array, one: KVCache) -> KVCache:
  """`cache` with row `row` replaced by the batch-1 cache `one` (keys and values hold the batch on axis 1)."""
  put = lambda f, o, axis: jax.lax.dynamic_update_slice_in_dim(f, o, row, axis=axis)
  return cache.replace(
    k=put(cache.k, one.k, 1),
    v=put(cache.v, one.v, 1),
    positions=put(cache.positions, one.positions, 0),
    valid=put(cache.valid, one.valid, 0),
    length=put(cache.length, one.length, 0),
  )


def count_width(widths: jax.Array, width: jax.Array | int, counts: jax.Array) -> jax.Array:
  """`widths` [names, largest width + 1] with counts [names] more forwards of query width `width`."""
  return widths.at[:, width].add(counts.astype(jnp.int32))


@functools.lru_cache(maxsize=64)
def _shapes(build: Callable[..., Any], *args: Any) -> Any:
  return jax.eval_shape(functools.partial(build, *args))


def host_zeros(build: Callable[..., Any], *args: Any) -> Any:
  """The pytree `build(*args)` would return, as numpy zeros: no device work, and its shapes are traced
  once per distinct (hashable) `build` and `args`, since starting a batch is on every decode call's path."""
  return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), _shapes(build, *args))
