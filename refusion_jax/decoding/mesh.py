"""Decoding on a device mesh: rows over the batch-parallel axes, parameters and cache by logical axes.

`rj.decode(..., mesh=mesh)` runs the one jitted decode loop
(`driver.decode_loop`) with every input placed by the shardings below and the
loop's output pinned to them (docs/method.md §5):

- decode rows are padded to a multiple of the batch-parallel devices
  (`driver.Engine`: padded rows stay idle), and they and the queue entries are
  split over the mesh axes the `batch` rule names;
- parameters are placed by their logical axes (`embed` over `fsdp`, heads /
  MLP / vocab over `tensor`, by `LOGICAL_AXIS_RULES`);
- the loop's knobs (thresholds, PRNG key, ids) are replicated;
- inside, the KV cache is pinned to (`layers`, `cache_batch`, `cache_length`,
  `kv_heads`, `head_dim`) and every other per-row loop array to `batch`
  (`constrain_cache`, `constrain_rows`), and the forward's activations to
  their `activation_*` axes, all through the same rules table. Between
  loop calls only the queue and the outputs travel to and from the host
  (the `driver.Engine` refills the queue); the rows and their caches stay put.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from refusion_jax.model.cache import KVCache
from refusion_jax.parallel.activations import constrain, normalize_rules
from refusion_jax.parallel.sharding import (
  LOGICAL_AXIS_RULES,
  Rules,
  logical_to_spec,
  state_shardings,
)

# Logical axes of the KVCache fields (k, v: [layers, batch, capacity, kv_heads, head_dim]).
_CACHE_KV = ("layers", "cache_batch", "cache_length", "kv_heads", "head_dim")
_CACHE_ROWS = ("cache_batch", "cache_length")


def constrain_cache(cache: KVCache) -> KVCache:
  """The cache pinned to its logical axes; the identity outside `activation_sharding` (one device)."""
  return cache.replace(
    k=constrain(cache.k, _CACHE_KV),
    v=constrain(cache.v, _CACHE_KV),
    positions=constrain(cache.positions, _CACHE_ROWS),
    valid=constrain(cache.valid, _CACHE_ROWS),
    length=constrain(cache.length, ("cache_batch",)),
  )


def constrain_rows(tree: Any) -> Any:
  """A decode loop's carry pinned by rows: caches by `constrain_cache`, every other [batch, ...] array by `batch`.

  Scalars (a loop counter) are left alone; every other leaf must lead with the batch.
  """

  def pin(x):
    if isinstance(x, KVCache):
      return constrain_cache(x)
    if np.ndim(x) == 0:
      return x
    return constrain(x, ("batch",) + (None,) * (np.ndim(x) - 1))

  return jax.tree.map(pin, tree, is_leaf=lambda x: isinstance(x, KVCache))


def row_shardings(tree: Any, mesh: Mesh, rules: Rules) -> Any:
  """Shardings of a decode loop's per-row tree: caches by their logical axes, scalars replicated,
  every other leaf split on its leading (row) axis, the rest replicated."""
  named = lambda axes: NamedSharding(mesh, logical_to_spec(axes, rules))

  def place(x):
    if isinstance(x, KVCache):
      kv, rows = named(_CACHE_KV), named(_CACHE_ROWS)
      return KVCache(k=kv, v=kv, positions=rows, valid=rows, length=named(("cache_batch",)))
    return named(()) if np.ndim(x) == 0 else named(("batch",))

  return jax.tree.map(place, tree, is_leaf=lambda x: isinstance(x, KVCache))


def place_params(params: nnx.State, mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> nnx.State:
  """Parameters on `mesh`, each split by its logical axes (a no-op for parameters already placed so)."""
  return jax.device_put(params, state_shardings(params, mesh, normalize_rules(rules)))


def loop_shardings(batch: Any, mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> Any:
  """The shardings of a decode loop's `batching.LoopState` on `mesh`: rows, queue and outputs split by row,
  counters replicated."""
  rules = normalize_rules(rules)
  return batch.shardings(functools.partial(row_shardings, mesh=mesh, rules=rules), NamedSharding(mesh, PartitionSpec()))
