"""Continuous batching inside the compiled decode loop: K rows kept busy over a queue of prompts.

Every jitted decoder (ReFusion, AR, MDM) carries a `LoopState`: K *rows*, each
decoding one prompt, and a queue of Q = `queue_entries(K)` *entries*, each
holding a prompt and its outputs. Each loop iteration first admits waiting
prompts into idle rows, in input order (the decoder's `admit`: a prefill into
that row), then runs one decode step for all rows (the decoder's `step`),
whose finished rows turn idle. Outputs are written by queue entry, and a
row's decode never depends on the other rows (docs/method.md §3.3), so each
prompt gets its B = 1 decode whatever row decodes it and whenever (bit for bit
at one row count; across row counts up to XLA's summation order, §3.3).

The queue is not the list of prompts: the host feeds it (`engine.Engine`). The
loop returns when a row turns idle with no prompt waiting while the host
holds more (`LoopState.more`), after `max_iterations` iterations, or when all is
done; the host then reads back the finished entries, refills them with the
next prompts and calls again. So the compiled shapes (K rows, Q entries, the
prompt bucket) do not depend on how many prompts a call decodes, and a server
can drive the loop in chunks (state in, state out) without recompiling. On a
mesh (`refusion_jax.decoding.mesh`) rows and entries are split over the
batch-parallel axes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from refusion_jax.decoding.contract import DecodeOutputs, Method, Sampling, Settings
from refusion_jax.decoding.mesh import constrain_rows
from refusion_jax.decoding.prefix_cache import (
  PREFILL_UNUSED,
  PrefixPool,
  PrefixReuse,
  QueuePrefix,
  reusing,
  store,
  usable_tokens,
)
from refusion_jax.model.cache import KVCache
from refusion_jax.model.transformer import Transformer

# The queue holds at least this many entries, and at least two per row: the host refills it about once
# per Q - K prompts decoded, so a few rows do not hand back to the host after every prompt or two.
MIN_QUEUE_ENTRIES = 32


def queue_entries(rows: int) -> int:
  """Q for K = `rows`: a multiple of K (so of a mesh's batch-parallel devices), at least 2K and MIN_QUEUE_ENTRIES."""
  return rows * max(2, -(-MIN_QUEUE_ENTRIES // rows))


def _key_data_shape() -> tuple[int, ...]:
  """The shape of one PRNG key's raw data (`jax.random.key_data`) under the default implementation."""
  return _key_data_shape_of(jax.config.jax_default_prng_impl)


@functools.cache
def _key_data_shape_of(impl: str) -> tuple[int, ...]:
  # Tracing a key costs a fraction of a millisecond, paid by every decode call before this cache.
  return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape


@flax.struct.dataclass
class LoopState:
  """The state a decode loop carries, and returns after each call.

  rows:          the decoder's per-row state (leading axis K; a `KVCache` in it has K on axis 1)
  entry:         [K] int32 queue entry of the prompt each row decodes (meaningful where busy)
  busy:          [K] bool the row is decoding
  queue_tokens:  [Q, P] int32 right-padded prompts (P = the prompt bucket)
  queue_lengths: [Q] int32 their true lengths
  queue_prompt:  [Q] int32 each entry's prompt: its number in the engine's input (order of admission)
  queue_key:     [Q, key data] uint32 each entry's noise key (`contract.Sampling.key`, as `jax.random.key_data`)
  queue_temperature: [Q] float32 each entry's temperature (`contract.Sampling.temperature`)
  queue_top_k, queue_top_p, queue_min_p: [Q] each entry's sampling filters (int32, float32, float32)
  waiting:       [Q] bool the entry holds a prompt not yet admitted
  more:          bool the host holds prompts not yet queued: a row left idle hands back to the host
  out:           `DecodeOutputs` of every entry
  widths:        [names, largest width + 1] int32 forwards counted by query width, one row per
                 name of the decoder's `width_names` (`DecodeResult.widths`)
  queue_prefix:  `prefix_cache.QueuePrefix`: where each entry's prompt blocks are in the prefix pool (None: no
                 prefix cache)
  prefix_pool:   `prefix_cache.PrefixPool`, the cached prompt blocks every engine of the cache shares (None: none)
  """

  rows: Any
  entry: jax.Array
  busy: jax.Array
  queue_tokens: jax.Array
  queue_lengths: jax.Array
  queue_prompt: jax.Array
  queue_key: jax.Array
  queue_temperature: jax.Array
  queue_top_k: jax.Array
  queue_top_p: jax.Array
  queue_min_p: jax.Array
  waiting: jax.Array
  more: jax.Array
  out: DecodeOutputs
  widths: jax.Array
  queue_prefix: QueuePrefix | None = None
  prefix_pool: PrefixPool | None = None

  @classmethod
  def create(cls, rows: Any, widths: np.ndarray, prompt_width: int, gen_length: int) -> LoopState:
    """K idle rows (K = the rows' leading size) before an empty queue of `queue_entries(K)` entries."""
    count = jax.tree.leaves(rows)[-1].shape[0]
    entries = queue_entries(count)
    return cls(
      rows=rows,
      entry=np.zeros((count,), np.int32),
      busy=np.zeros((count,), bool),
      queue_tokens=np.zeros((entries, prompt_width), np.int32),
      queue_lengths=np.ones((entries,), np.int32),
      queue_prompt=np.zeros((entries,), np.int32),
      queue_key=np.zeros((entries, *_key_data_shape()), np.uint32),
      queue_temperature=np.zeros((entries,), np.float32),
      queue_top_k=np.zeros((entries,), np.int32),
      queue_top_p=np.ones((entries,), np.float32),
      queue_min_p=np.zeros((entries,), np.float32),
      waiting=np.zeros((entries,), bool),
      more=np.bool_(False),
      out=DecodeOutputs.empty(entries, gen_length),
      widths=widths,
    )

  def shardings(self, rows: Callable[[Any], Any], replicated: Any) -> LoopState:
    """The LoopState's shardings on a mesh: `rows(tree)` for the rows, queue and outputs, the rest replicated."""
    return self.replace(
      rows=rows(self.rows),
      entry=rows(self.entry),
      busy=rows(self.busy),
      queue_tokens=rows(self.queue_tokens),
      queue_lengths=rows(self.queue_lengths),
      queue_prompt=rows(self.queue_prompt),
      queue_key=rows(self.queue_key),
      queue_temperature=rows(self.queue_temperature),
      queue_top_k=rows(self.queue_top_k),
      queue_top_p=rows(self.queue_top_p),
      queue_min_p=rows(self.queue_min_p),
      waiting=rows(self.waiting),
      more=replicated,
      out=rows(self.out),
      widths=replicated,
      queue_prefix=rows(self.queue_prefix),
      prefix_pool=None if self.prefix_pool is None else PrefixPool(replicated, replicated, replicated),
    )


def run_rows(
  state: LoopState, max_iterations: jax.Array, method: type[Method], model: Transformer, knobs: Any, settings: Settings
) -> LoopState:
  """Admit and step until nothing is left to do, the host must refill the queue, or `max_iterations` steps ran.

  `method`'s admit and step get `model`, the traced `knobs` and the static `settings` first
  (`contract.Admit`, `contract.Step`). Call under `jax.jit`.
  """
  entries = state.waiting.shape[0]

  def can_admit(b: LoopState) -> jax.Array:
    return jnp.any(~b.busy) & jnp.any(b.waiting)

  def sampling(b: LoopState, entry: jax.Array) -> Sampling:
    return Sampling(
      key=jax.random.wrap_key_data(b.queue_key[entry]),
      temperature=b.queue_temperature[entry],
      top_k=b.queue_top_k[entry],
      top_p=b.queue_top_p[entry],
      min_p=b.queue_min_p[entry],
    )

  def admit(b: LoopState, row: jax.Array, entry: jax.Array) -> tuple[Any, DecodeOutputs]:
    return method.admit(
      model,
      knobs,
      settings,
      b.rows,
      b.out,
      row,
      entry,
      sampling(b, entry),
      b.queue_tokens[entry],
      b.queue_lengths[entry],
    )

  def admit_next(b: LoopState) -> LoopState:
    # The first idle row takes the waiting prompt that comes first in the input.
    row = jnp.argmin(b.busy)
    entry = jnp.argmin(jnp.where(b.waiting, b.queue_prompt, jnp.iinfo(jnp.int32).max))
    if b.prefix_pool is None:
      rows, out = admit(b, row, entry)
    else:
      rows, out, b = _admit_with_prefix(b, row, entry, admit)
    return b.replace(
      rows=rows,
      out=out,
      entry=b.entry.at[row].set(entry),
      busy=b.busy.at[row].set(True),
      waiting=b.waiting.at[entry].set(False),
    )

  def body(carry: tuple[LoopState, jax.Array]) -> tuple[LoopState, jax.Array]:
    b, iteration = carry
    b = jax.lax.while_loop(can_admit, admit_next, b)
    entry = jnp.where(b.busy, b.entry, entries)
    rows, out, widths, finished = method.step(
      model, knobs, settings, b.rows, b.out, b.widths, b.busy, entry, sampling(b, b.entry)
    )
    return b.replace(rows=rows, out=out, widths=widths, busy=b.busy & ~finished), iteration + 1

  def cond(carry: tuple[LoopState, jax.Array]) -> jax.Array:
    b, iteration = carry
    starved = b.more & jnp.any(~b.busy) & ~jnp.any(b.waiting)
    return (jnp.any(b.busy) | can_admit(b)) & ~starved & (iteration < max_iterations)

  def pin(carry: tuple[LoopState, jax.Array]) -> tuple[LoopState, jax.Array]:
    # On a mesh the rows and the outputs keep their row sharding in every iteration (not left to propagation).
    b, iteration = carry
    return b.replace(rows=constrain_rows(b.rows), out=constrain_rows(b.out)), iteration

  state, _ = jax.lax.while_loop(cond, lambda carry: pin(body(carry)), pin((state, jnp.int32(0))))
  return state


def _admit_with_prefix(
  b: LoopState, row: jax.Array, entry: jax.Array, admit: Callable[[LoopState, jax.Array, jax.Array], Any]
) -> tuple[Any, DecodeOutputs, LoopState]:
  """`admit` of `entry` into `row` offered the entry's cached prompt prefix (`prefix_cache.reusing`: a method whose
  admit prefills through `prompts.prefill` takes it), then the prompt's new blocks stored in the pool from the
  row's cache; `b` returned with the pool and the entry's reused tokens."""
  plan = jax.tree.map(lambda x: x[entry], b.queue_prefix)
  tokens = usable_tokens(b.prefix_pool, plan.slot, plan.generation, plan.cached)
  with reusing(PrefixReuse(b.prefix_pool, plan.slot, tokens)) as reuse:
    rows, out = admit(b, row, entry)
  pool = b.prefix_pool
  caches = [x for x in jax.tree.leaves(rows, is_leaf=_is_cache) if isinstance(x, KVCache)]
  if reuse.used and len(caches) == 1:  # the row's cache holds the prompt, as the prefill left it
    pool = store(pool, caches[0], row, plan.slot, plan.generation, plan.cached, b.queue_lengths[entry])
  reused = tokens if reuse.used else jnp.int32(PREFILL_UNUSED)
  queue_prefix = b.queue_prefix.replace(reused=b.queue_prefix.reused.at[entry].set(reused))
  return rows, out, b.replace(prefix_pool=pool, queue_prefix=queue_prefix)


def _is_cache(x: Any) -> bool:
  return isinstance(x, KVCache)


def put_row(full: Any, row: jax.Array, one: Any) -> Any:
  """`full` (leading axis K; a `KVCache`'s batch axis) with entry `row` replaced by the size-1 `one` (same tree)."""

  def put(f, o):
    if isinstance(f, KVCache):
      return f.put_rows(row, o)
    return jax.lax.dynamic_update_slice_in_dim(f, o.astype(f.dtype), row, axis=0)

  return jax.tree.map(put, full, one, is_leaf=lambda x: isinstance(x, KVCache))


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
