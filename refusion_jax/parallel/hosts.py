"""Arrays across processes: placing host values and device arrays on a sharding, and reading them back whole.

Within one process `jax.device_put` does it all. On a mesh that spans
processes, a value every process holds whole (host arrays, a PRNG key) is
assembled shard by shard from it, an array spread over the processes in
another layout is resharded by one compiled identity (whose collectives every
backend has, where `device_put` would need cross-host transfers that some
backends lack), and rows split over processes are gathered to be read.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


def place(values: Any, shardings: Any) -> Any:
  """`values` on `shardings` (a prefix tree of them), every leaf placed the same way on every call.

  A leaf that already is a `jax.Array` on its target sharding passes through untouched (no dispatch): a
  loop that hands its own outputs back in pays nothing for them.
  """
  flat_shardings = jax.tree.leaves(shardings)
  subtrees = jax.tree.structure(shardings).flatten_up_to(values)
  pairs = [(leaf, sharding) for subtree, sharding in zip(subtrees, flat_shardings) for leaf in jax.tree.leaves(subtree)]
  placed, put, across = [], [], []
  for i, (leaf, sharding) in enumerate(pairs):
    if isinstance(leaf, jax.Array) and leaf.sharding == sharding:
      placed.append(leaf)
      continue
    placed.append(None)
    if sharding.is_fully_addressable:
      put.append(i)
    elif not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
      placed[i] = assembled(leaf, sharding)
    else:
      across.append(i)
  if put:  # one batched transfer, not one dispatch per leaf
    moved = jax.device_put([pairs[i][0] for i in put], [pairs[i][1] for i in put])
    for i, leaf in zip(put, moved):
      placed[i] = leaf
  if across:
    moved = jax.jit(_same, out_shardings=[pairs[i][1] for i in across])([pairs[i][0] for i in across])
    for i, leaf in zip(across, moved):
      placed[i] = leaf
  return jax.tree.unflatten(jax.tree.structure(values), placed)


def assembled(leaf: Any, sharding: jax.sharding.Sharding) -> jax.Array:
  """A value every process holds whole, as one array over `sharding`'s devices in all processes."""
  if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    data = assembled(jax.random.key_data(leaf), sharding)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
  whole = np.asarray(leaf)
  return jax.make_array_from_callback(whole.shape, sharding, lambda index: whole[index])


def to_host(values: Any) -> Any:
  """`values` as host arrays, whole in every process (rows split over processes are gathered)."""

  def fetch(leaf: Any) -> Any:
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return jax.device_get(leaf)

  if all(not isinstance(leaf, jax.Array) or leaf.is_fully_addressable for leaf in jax.tree.leaves(values)):
    return jax.device_get(values)  # one batched read
  return jax.tree.map(fetch, values)


def _same(leaves: list[jax.Array]) -> list[jax.Array]:
  return leaves


def default_device() -> jax.Device:
  """Where jitted work runs without a mesh: `jax.default_device` where set, else the first device."""
  default = jax.config.jax_default_device
  if isinstance(default, str):  # a platform name
    return jax.devices(default)[0]
  return default or jax.devices()[0]
