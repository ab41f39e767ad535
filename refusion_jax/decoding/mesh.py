"""Decoding on a device mesh: rows over the batch-parallel axes, parameters and cache by logical axes.

`rj.decode(..., mesh=mesh)` runs the one jitted decode loop
(`loop.decode_loop`) with every input placed by the shardings below and the
loop's output pinned to them (docs/method.md §5):

- decode rows are padded to a multiple of the batch-parallel devices
  (`engine.Engine`: padded rows stay idle), and they and the queue entries are
  split over the mesh axes the `batch` rule names;
- parameters are placed by their logical axes (`embed` over `fsdp`, heads /
  MLP / vocab over `tensor`, by `LOGICAL_AXIS_RULES`);
- the loop's knobs (thresholds, PRNG key, ids) are replicated;
- inside, the KV cache is pinned to (`layers`, `cache_batch`, `cache_length`,
  `kv_heads`, `head_dim`) and every other per-row loop array to `batch`
  (`constrain_cache`, `constrain_rows`), and the forward's activations to
  their `activation_*` axes, all through the same rules table. Between
  loop calls only the queue and the outputs travel to and from the host
  (the `engine.Engine` refills the queue); the rows and their caches stay put.
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
from refusion_jax.parallel.hosts import default_device
from refusion_jax.parallel.sharding import (
  LOGICAL_AXIS_RULES,
  Rules,
  batch_parallel_ways,
  logical_to_spec,
  state_shardings,
)

# Logical axes of the KVCache fields (k, v: [layers, batch, capacity, kv_heads, head_dim]).
_CACHE_KV = ("layers", "cache_batch", "cache_length", "kv_heads", "head_dim")
_CACHE_ROWS = ("cache_batch", "cache_length")
# Of the prefix pool's keys and values ([layers, blocks, block tokens, kv_heads, head_dim]).
_POOL_KV = ("layers", None, None, "kv_heads", "head_dim")


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
  shardings = batch.shardings(
    functools.partial(row_shardings, mesh=mesh, rules=rules), NamedSharding(mesh, PartitionSpec())
  )
  if batch.prefix_pool is None:
    return shardings
  # The prefix pool serves every row: replicated over the batch-parallel axes, split by heads as the cache is.
  blocks = NamedSharding(mesh, logical_to_spec(_POOL_KV, rules))
  return shardings.replace(prefix_pool=shardings.prefix_pool.replace(k=blocks, v=blocks))


def padded_rows(rows: int, mesh: jax.sharding.Mesh | None, rules: Rules = LOGICAL_AXIS_RULES) -> int:
  """`rows` rounded up to a multiple of the mesh's batch-parallel ways (the extra rows stay idle)."""
  ways = 1 if mesh is None else batch_parallel_ways(mesh, rules)
  return -(-rows // ways) * ways


def pick_rows_on(mesh: jax.sharding.Mesh | None, rules: Rules = LOGICAL_AXIS_RULES) -> bool:
  """Whether a forward may take a subset of the rows on `mesh` (`Method.decoder`'s `pick_rows`): not on a TPU,
  and not where rows are split over devices.

  XLA's TPU compiler aborts on a ReFusion forward that picks rows (a failed check in its gather emitter), even
  on one chip; where rows are split over devices it has aborted on the gather across devices too (the versions
  and commands: results/README.md, "Measurements the code relies on"). Picking rows only saves work.
  """
  devices = [default_device()] if mesh is None else list(mesh.devices.flat)
  if any(device.platform == "tpu" for device in devices):
    return False
  return mesh is None or batch_parallel_ways(mesh, rules) == 1
