"""The shared-prefix cache: prompt KV kept in a device pool and reused by later prompts that begin alike.

A prompt's KV at positions 0..P-1 depends only on its tokens 0..P-1 (causal
attention; ReFusion's prompt KV is ordinary causal KV, docs/method.md §3.4),
so a prompt that begins with the same tokens as an earlier one may take the
earlier one's KV for that prefix and prefill only the rest (docs/serving.md,
"The prefix cache"). Three parts:

* a device-resident pool (`PrefixPool`) of fixed-size blocks of
  `PREFIX_BLOCK_TOKENS` tokens' keys and values, each slot tagged with the
  generation of its content;
* a host-side index (`PrefixCache`) over block-aligned token prefixes: a block
  is found by its tokens and its parent block (a chain, as vLLM hashes
  blocks), least recently used blocks are evicted first (the deepest of a
  chain before its parents), and a bounded number of slots is all it holds;
* the loop's side (`usable_tokens`, `restore`, `store`, `reusing`): at
  admission the leading blocks whose slots still hold the expected
  generation are copied into the row's cache and only the rest is prefilled
  (`prompts.prefill` reads `active_reuse`), and the prompt's new blocks are
  written to their slots with their generations.

Nothing here can make an answer wrong: a slot's generation is checked on the
device when the prompt is admitted, so a block evicted, reassigned or never
written (its writer cancelled) between the host's plan and the admission is
prefilled as if it had never been cached.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from refusion_jax.model.cache import KVCache
from refusion_jax.model.config import ModelConfig

# Tokens per pool block: a prefix is reused in whole blocks, so a hit leaves at most this many - 1 of its tokens to
# prefill again, and a prompt shorter than this + 1 shares nothing.
PREFIX_BLOCK_TOKENS = 16

# `QueuePrefix.reused` of a prompt admitted by a method that takes no cached prefix.
PREFILL_UNUSED = -2

# Slot generations wrap below 2**31 (int32 on the device); a slot would have to be reassigned 2**31 times while one
# queued prompt waits for a wrong match.
_GENERATIONS = 2**31 - 1


@flax.struct.dataclass
class PrefixPool:
  """The device pool of cached prompt blocks.

  k, v:       [layers, blocks, block tokens, kv_heads, head_dim] keys and values (as a `KVCache` stores them)
  generation: [blocks] int32 the generation of each slot's content, -1 where none was written
  """

  k: jax.Array
  v: jax.Array
  generation: jax.Array

  @property
  def block_tokens(self) -> int:
    return self.k.shape[2]


@flax.struct.dataclass
class QueuePrefix:
  """Per queue entry (Q of them, M = prompt bucket / block tokens): where its prompt's blocks are in the pool.

  slot:       [Q, M] int32 the pool slot of each block: to read (the leading `cached` ones), to write (the rest;
              -1: neither)
  generation: [Q, M] int32 the generation the slot holds (reads) or will hold (writes)
  cached:     [Q] int32 the leading blocks the host found cached (the device checks their generations)
  reused:     [Q] int32 written at admission: the prompt tokens taken from the pool; -1 until admitted,
              PREFILL_UNUSED where the method's admit takes no prefix (it does not prefill: MDM)
  """

  slot: jax.Array
  generation: jax.Array
  cached: jax.Array
  reused: jax.Array

  @classmethod
  def empty(cls, entries: int, blocks: int) -> QueuePrefix:
    """Nothing planned, as host arrays."""
    none = lambda: np.full((entries, blocks), -1, np.int32)
    return cls(none(), none(), np.zeros((entries,), np.int32), np.full((entries,), -1, np.int32))


def pool_shape(config: ModelConfig, blocks: int, block_tokens: int) -> tuple[int, ...]:
  """The shape of the pool's keys (and values)."""
  return (config.num_layers, blocks, block_tokens, config.num_kv_heads, config.head_dim)


# --- inside the loop -------------------------------------------------------------------------------------------


def usable_tokens(pool: PrefixPool, slot: jax.Array, generation: jax.Array, cached: jax.Array) -> jax.Array:
  """[] int32 the prompt tokens one queue entry may take from the pool: its leading cached blocks ([M] `slot`,
  `generation`; `cached` of them) whose slots still hold the generation the host planned for."""
  blocks = slot.shape[0]
  holds = pool.generation[jnp.clip(slot, 0, pool.generation.shape[0] - 1)] == generation
  ok = (jnp.arange(blocks) < cached) & (slot >= 0) & holds
  return jnp.sum(jnp.cumprod(ok.astype(jnp.int32))) * pool.block_tokens


def restore(cache: KVCache, pool: PrefixPool, slot: jax.Array, tokens: jax.Array) -> KVCache:
  """A fresh one-row `cache` holding the pool's blocks `slot` [M] at entries 0..M·block-1, of which the first
  `tokens` [] are valid (positions = entries): the prompt prefix to prefill after."""
  layers, blocks, block, heads, dim = pool.k.shape
  span = slot.shape[0] * block
  gather = lambda x: x[:, jnp.clip(slot, 0, blocks - 1)].reshape(layers, 1, span, heads, dim).astype(cache.k.dtype)
  put = lambda full, part: jax.lax.dynamic_update_slice_in_dim(full, part, 0, axis=2)
  index = jnp.arange(cache.capacity, dtype=jnp.int32)[None]
  return cache.replace(
    k=put(cache.k, gather(pool.k)),
    v=put(cache.v, gather(pool.v)),
    positions=index,
    valid=index < tokens,
    length=jnp.reshape(tokens, (1,)).astype(jnp.int32),
  )


def store(
  pool: PrefixPool,
  cache: KVCache,
  row: jax.Array,
  slot: jax.Array,
  generation: jax.Array,
  cached: jax.Array,
  length: jax.Array,
) -> PrefixPool:
  """The pool with the new blocks of the prompt just prefilled into row `row` of `cache` written to their slots:
  blocks j >= `cached` with a slot, whole within the prompt's `length` tokens, tagged with their `generation`."""
  layers, blocks, block, heads, dim = pool.k.shape
  count = slot.shape[0]
  index = jnp.arange(count)
  write = (index >= cached) & (slot >= 0) & ((index + 1) * block <= length)
  target = jnp.where(write, slot, blocks)  # out of range: dropped

  def blocks_of(x: jax.Array) -> jax.Array:
    one = jax.lax.dynamic_slice_in_dim(x, row, 1, axis=1)[:, 0, : count * block]
    return one.reshape(layers, count, block, heads, dim).astype(pool.k.dtype)

  return pool.replace(
    k=pool.k.at[:, target].set(blocks_of(cache.k), mode="drop"),
    v=pool.v.at[:, target].set(blocks_of(cache.v), mode="drop"),
    generation=pool.generation.at[target].set(generation, mode="drop"),
  )


@dataclasses.dataclass
class PrefixReuse:
  """What `prompts.prefill` reads while one admission is traced under `reusing`: the pool, the entry's block slots
  [M] and the prompt tokens [] it may take from them (`usable_tokens`). `used` records (at trace time) that a
  prefill took them, so the loop knows the row's cache holds the prompt to store."""

  pool: PrefixPool
  slot: jax.Array
  tokens: jax.Array
  used: bool = False


_ACTIVE = threading.local()


@contextlib.contextmanager
def reusing(reuse: PrefixReuse) -> Iterator[PrefixReuse]:
  """Trace the block (one admission) with `reuse` offered to `prompts.prefill`."""
  outer = getattr(_ACTIVE, "reuse", None)
  _ACTIVE.reuse = reuse
  try:
    yield reuse
  finally:
    _ACTIVE.reuse = outer


def active_reuse() -> PrefixReuse | None:
  """The cached prefix offered to the admission being traced, or None (no prefix cache)."""
  return getattr(_ACTIVE, "reuse", None)


# --- the host's index ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Block:
  """A cached block: its index key (parent block, tokens), its slot and the generation of the slot's content."""

  key: tuple
  slot: int
  generation: int


@dataclasses.dataclass(frozen=True)
class PrefixPlan:
  """Where one prompt's blocks are in the pool (`QueuePrefix`'s row for its entry), and the blocks it allocated
  (to forget if the prompt is dropped before it is admitted: `PrefixCache.discard`)."""

  slot: np.ndarray
  generation: np.ndarray
  cached: int
  allocated: tuple[_Block, ...]


class PrefixCache:
  """The shared-prefix cache of one model: a device pool of `tokens` // `block_tokens` blocks and its LRU index.

  Engines of the same model (an `EngineLadder`'s buckets, a `Sampler`'s engines) may share one: each plans its
  prompts here (`plan`) when it queues them and moves the device pool (`pool`) in and out of its loop state
  around each call. Counters in vLLM's words (tokens; `stats`): `prefix_cache_queries`, the prompt tokens
  admitted, and `prefix_cache_hits`, those taken from the pool.
  """

  def __init__(self, config: ModelConfig, tokens: int, *, block_tokens: int = PREFIX_BLOCK_TOKENS):
    """
    Args:
      config: the model's (inference view's) config: the pool's layers, heads and dtype.
      tokens: the pool's size in prompt tokens (rounded down to whole blocks; at least one block).
      block_tokens: tokens per block.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < block_tokens:
      raise ValueError(
        f"A prefix cache of {tokens!r} tokens holds no block of {block_tokens}; give at least {block_tokens} "
        "(e.g. 4096), or 0 to turn the cache off."
      )
    self.config, self.block_tokens = config, block_tokens
    self.blocks = tokens // block_tokens
    self.pool: PrefixPool | None = None  # on the device once an engine has made it (`make_pool`)
    self._index: dict[tuple, _Block] = {}
    self._recent: collections.OrderedDict[int, _Block] = collections.OrderedDict()  # by slot, least recent first
    self._free = list(range(self.blocks - 1, -1, -1))
    self._generation = np.zeros(self.blocks, np.int64)
    self.queries = self.hits = self.requests = self.hit_requests = 0

  @property
  def tokens(self) -> int:
    """The pool's size in tokens."""
    return self.blocks * self.block_tokens

  @property
  def pool_bytes(self) -> int:
    """Bytes of the device pool (keys, values and generations)."""
    shape = pool_shape(self.config, self.blocks, self.block_tokens)
    return 2 * int(np.prod(shape)) * np.dtype(self.config.compute_dtype).itemsize + 4 * self.blocks

  @property
  def used_blocks(self) -> int:
    return len(self._recent)

  def make_pool(self, sharding: PrefixPool) -> PrefixPool:
    """The pool (made empty on first use, on `sharding`: a `PrefixPool` of shardings)."""
    if self.pool is None:
      shape = pool_shape(self.config, self.blocks, self.block_tokens)
      dtype = self.config.compute_dtype
      empty = lambda: PrefixPool(
        jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.full((self.blocks,), -1, jnp.int32)
      )
      self.pool = jax.jit(empty, out_shardings=sharding)()
    return self.pool

  def plan(self, prompt: Sequence[int], blocks: int) -> PrefixPlan:
    """Where `prompt`'s first `blocks` whole blocks are (to read) or go (to write): the leading ones found in the
    index are read, up to the last block that leaves a token to prefill (the prefill yields the first answer
    token's logits); the rest get slots, least recently used ones evicted."""
    size = self.block_tokens
    slot, generation = np.full(blocks, -1, np.int32), np.full(blocks, -1, np.int32)
    whole, readable = min(len(prompt) // size, blocks), min((len(prompt) - 1) // size, blocks)
    chain: list[_Block] = []
    allocated: list[_Block] = []
    parent: tuple = ()
    cached = 0
    for j in range(whole):
      key = (parent, tuple(int(t) for t in prompt[j * size : (j + 1) * size]))
      block = self._index.get(key)
      if block is None:
        block = self._allocate(key, chain)
        if block is None:  # every slot holds a block of this very prompt
          break
        allocated.append(block)
      elif j < readable and not allocated:
        cached += 1
      else:  # found, but the prompt's last token must be prefilled: neither read nor written
        chain.append(block)
        parent = (block.slot, block.generation)
        continue
      slot[j], generation[j] = block.slot, block.generation
      chain.append(block)
      parent = (block.slot, block.generation)
    for block in reversed(chain):  # the deepest least recent: evicted before its parents
      self._recent.move_to_end(block.slot)
    return PrefixPlan(slot, generation, cached, tuple(allocated))

  def _allocate(self, key: tuple, keep: list[_Block]) -> _Block | None:
    """A slot for a new block (free, else the least recently used block's, not one of `keep`), or None."""
    if self._free:
      slot = self._free.pop()
    else:
      kept = {block.slot for block in keep}
      victim = next((b for b in self._recent.values() if b.slot not in kept), None)
      if victim is None:
        return None
      del self._index[victim.key], self._recent[victim.slot]
      slot = victim.slot
    self._generation[slot] = self._generation[slot] % _GENERATIONS + 1
    block = _Block(key, slot, int(self._generation[slot]))
    self._index[key] = self._recent[slot] = block
    return block

  def discard(self, plan: PrefixPlan) -> None:
    """Forget the blocks `plan` allocated: its prompt was dropped before its admission wrote them."""
    for block in plan.allocated:
      if self._index.get(block.key) is block:
        del self._index[block.key], self._recent[block.slot]
        self._free.append(block.slot)

  def clear(self) -> None:
    """Forget every block and the pool (a loop call that failed took the pool with it); generations go on, so no
    plan made before matches a block written after."""
    self.pool = None
    self._index.clear()
    self._recent.clear()
    self._free = list(range(self.blocks - 1, -1, -1))

  def record(self, prompt_tokens: int, reused: int) -> None:
    """Count one admitted prompt of `prompt_tokens` tokens, `reused` of them taken from the pool."""
    self.queries += prompt_tokens
    self.hits += reused
    self.requests += 1
    self.hit_requests += reused > 0

  @property
  def stats(self) -> dict[str, int]:
    """The counters, named as the server's /metrics names them."""
    return {
      "prefix_cache_queries": self.queries,
      "prefix_cache_hits": self.hits,
      "prefix_cache_requests": self.requests,
      "prefix_cache_hit_requests": self.hit_requests,
      "prefix_cache_blocks": self.blocks,
      "prefix_cache_blocks_used": self.used_blocks,
    }


class PrefixQueue:
  """One engine's side of a `PrefixCache`: the plans of its queue entries, the host's copy of the loop state's
  `QueuePrefix`, and the admissions it reads back (counted in the cache and kept per request)."""

  def __init__(self, cache: PrefixCache, entries: int, prompt_width: int):
    self.cache = cache
    self.blocks = prompt_width // cache.block_tokens
    self.host = QueuePrefix.empty(entries, self.blocks)
    self._plans: dict[int, tuple[PrefixPlan, int]] = {}  # entry -> (its plan, its prompt's length) until admitted
    self.unused = False  # the method's admit takes no prefix (found at the first admission): nothing is planned

  def plan(self, entry: int, prompt: Sequence[int]) -> None:
    """Plan the prompt just queued in `entry`."""
    if self.unused:
      return
    plan = self.cache.plan(prompt, self.blocks)
    self.host.slot[entry], self.host.generation[entry] = plan.slot, plan.generation
    self.host.cached[entry], self.host.reused[entry] = plan.cached, -1
    self._plans[entry] = plan, len(prompt)

  def arrays(self) -> QueuePrefix:
    """Copies of the host's arrays, for the loop state (a CPU device may keep using a buffer it was given)."""
    return jax.tree.map(np.copy, self.host)

  def admitted(self, reused: np.ndarray) -> dict[int, int]:
    """Read back the loop's `reused` [Q]: the entries admitted since the last call, with the prompt tokens each
    took from the pool (counted in the cache)."""
    self.host.reused[:] = reused
    done = {}
    for entry in [e for e in self._plans if reused[e] >= 0 or reused[e] == PREFILL_UNUSED]:
      plan, length = self._plans.pop(entry)
      if reused[entry] == PREFILL_UNUSED:
        self.unused = True
        self.cache.discard(plan)
        continue
      self.cache.record(length, int(reused[entry]))
      done[entry] = int(reused[entry])
    if self.unused:  # forget what the entries queued meanwhile planned
      for entry in list(self._plans):
        self.drop(entry)
      self.host = QueuePrefix.empty(*self.host.slot.shape)
    return done

  def drop(self, entry: int) -> None:
    """The prompt of `entry` left before its admission: the blocks it was to write are forgotten."""
    if entry in self._plans:
      self.cache.discard(self._plans.pop(entry)[0])
