"""Reading any orbax PyTree item (tunix, MaxText, ours) by dotted array name, without its writer's classes.

An orbax item directory (`<step>/<item>/` with a `_METADATA` file) records its
tree: nested keys down to array leaves with shapes and dtypes. `item_arrays`
lists those leaves as `{"layers.0.attn.q_proj.w.value": (shape, dtype)}`;
`fetcher` restores any subset of them, each straight onto the sharding and
dtype asked for (orbax reads only the shards each device needs, and casts).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from refusion_jax.checkpoints.restore import Fetch

METADATA_FILE = "_METADATA"


def _key_name(key: Any) -> str:
  return str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key))))


def _checkpointer() -> ocp.Checkpointer:
  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler())


def item_arrays(item_dir: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """{dotted name: (shape, dtype)} of every array leaf of the item at `item_dir`.

  Raises:
    ValueError: the item's metadata cannot be read (not an orbax PyTree item, or corrupt).
  """
  try:
    tree = _checkpointer().metadata(item_dir).item_metadata.tree
  except Exception as error:  # orbax raises many types for unreadable metadata
    raise ValueError(
      f"Could not read the orbax metadata of {item_dir} ({type(error).__name__}: {error}); "
      "it is not an orbax PyTree item or it is corrupt."
    ) from error
  arrays = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    shape = getattr(leaf, "shape", None)
    if shape is not None:
      arrays[".".join(_key_name(k) for k in path)] = (tuple(shape), np.dtype(leaf.dtype))
  return arrays


def _nest(items: dict[str, Any]) -> dict:
  tree: dict = {}
  for name, value in items.items():
    *parents, leaf = name.split(".")
    node = tree
    for key in parents:
      node = node.setdefault(key, {})
    node[leaf] = value
  return tree


def _pick(tree: dict, name: str) -> Any:
  for key in name.split("."):
    tree = tree[key]
  return tree


def fetcher(item_dir: str) -> Fetch:
  """A `Fetch` restoring named arrays of the item at `item_dir` onto the targets' shardings and dtypes."""
  item_dir = os.path.abspath(item_dir)

  def fetch(requests: Sequence[tuple[str, jax.ShapeDtypeStruct]]) -> list[jax.Array]:
    targets = _nest(dict(requests))
    restore_args = ocp.checkpoint_utils.construct_restore_args(targets)
    args = ocp.args.PyTreeRestore(item=targets, restore_args=restore_args, partial_restore=True)
    try:
      restored = _checkpointer().restore(item_dir, args=args)
    except Exception as error:  # tensorstore / orbax raise many types for unreadable arrays
      raise ValueError(
        f"Could not read {[name for name, _ in requests][:3]} from {item_dir} ({type(error).__name__}: {error}); "
        "the checkpoint may be truncated or corrupt."
      ) from error
    return [_pick(restored, name) for name, _ in requests]

  return fetch
