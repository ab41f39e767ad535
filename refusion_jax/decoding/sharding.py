"""Decoding on a device mesh: rows over the batch-parallel axes, parameters and cache by logical axes.

`generate(..., mesh=mesh)` (and the baselines) hand their compiled loop to
`sharded_loop`, which runs the same loop body under one `jax.jit` with
explicit in/out shardings (docs/method.md §5):

- decode rows and queued prompts are padded to a multiple of the
  batch-parallel devices (`run_decoder`: padded queue entries are never
  decoded) and split over the mesh axes the `batch` rule names;
- parameters are placed by their logical axes (`embed` over `fsdp`, heads /
  MLP / vocab over `tensor`, by `LOGICAL_AXIS_RULES`);
- the loop's knobs (thresholds, PRNG key, ids) are replicated;
- inside, the KV cache is pinned to (`layers`, `cache_batch`, `cache_length`,
  `kv_heads`, `head_dim`) and every other per-row loop array to `batch`
  (`constrain_cache`, `constrain_rows`), and the forward's activations to
  their `activation_*` axes, all through the same rules table. The loop
  itself never leaves the device; the answers are read back once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from refusion_jax.model.cache import KVCache
from refusion_jax.parallel.activations import constrain, normalize_rules, sharded_activations
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


def row_sharded_while_loop(cond: Callable, body: Callable, init: Any) -> Any:
  """`lax.while_loop` whose carry keeps its row sharding in every iteration (not left to propagation)."""
  return jax.lax.while_loop(cond, lambda carry: constrain_rows(body(carry)), constrain_rows(init))


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


def pad_rows(prompt: np.ndarray, lengths: np.ndarray, multiple: int) -> tuple[np.ndarray, np.ndarray]:
  """Prompts [B, P] and lengths [B] padded with copies of row 0 to a multiple of `multiple` rows."""
  extra = -prompt.shape[0] % multiple
  if not extra:
    return prompt, lengths
  return (
    np.concatenate([prompt, np.repeat(prompt[:1], extra, axis=0)]),
    np.concatenate([lengths, np.repeat(lengths[:1], extra)]),
  )


def place_params(params: nnx.State, mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> nnx.State:
  """Parameters on `mesh`, each split by its logical axes (a no-op for parameters already placed so)."""
  return jax.device_put(params, state_shardings(params, mesh, normalize_rules(rules)))


def _split_keywords(keywords: dict) -> tuple[tuple, dict]:
  """A loop's bound keywords: static ones (hashable: settings, sizes, switches) and traced ones (arrays, knobs)."""
  traced = {k: v for k, v in keywords.items() if any(isinstance(x, jax.Array) for x in jax.tree.leaves(v))}
  return tuple(sorted((k, v) for k, v in keywords.items() if k not in traced)), traced


# (loop function, static keywords, graphdef, mesh, rules) -> the jitted, sharded loop.
_JITTED: dict[tuple, Callable] = {}


def _jitted_loop(
  func: Callable, static: tuple, graphdef: nnx.GraphDef, params: nnx.State, batch: Any, mesh: Mesh, rules
) -> Callable:
  key = (func, static, graphdef, mesh, rules)
  if key not in _JITTED:
    # The loop's own jit is replaced by this one (its body, under `counts_compilations`, still counts traces).
    body = getattr(func, "__wrapped__", func)

    def run(params, batch, max_iterations, traced):
      return body(graphdef, params, batch, max_iterations, **dict(static), **traced)

    replicated = NamedSharding(mesh, PartitionSpec())
    rows = batch.shardings(functools.partial(row_shardings, mesh=mesh, rules=rules), replicated)
    _JITTED[key] = jax.jit(
      sharded_activations(run, mesh, rules),
      in_shardings=(state_shardings(params, mesh, rules), rows, replicated, replicated),
      out_shardings=rows,
    )
  return _JITTED[key]


def sharded_loop(loop: functools.partial, mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> Callable:
  """`loop` (a decoder's jitted loop with its knobs bound by `functools.partial`) run on `mesh`.

  Returns:
    A function of (graphdef, params, batch, max_iterations) that runs the loop
    over `batch` (a `batching.Batch` whose rows and queue are multiples of the
    mesh's batch-parallel ways) and returns the new one, rows split over the mesh.
  """
  if not isinstance(loop, functools.partial) or loop.args:
    raise TypeError(f"sharded_loop needs the loop as functools.partial(loop_fn, **knobs), got {loop!r}.")
  rules = normalize_rules(rules)
  static, traced = _split_keywords(loop.keywords)

  def call(graphdef: nnx.GraphDef, params: nnx.State, batch: Any, max_iterations: np.ndarray):
    jitted = _jitted_loop(loop.func, static, graphdef, params, batch, mesh, rules)
    return jitted(place_params(params, mesh, rules), batch, max_iterations, traced)

  return call
