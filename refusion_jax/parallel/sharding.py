"""Device mesh and the one table that maps logical axis names to mesh axes.

Every parameter carries logical axis names (`embed`, `heads`, `kv_heads`,
`head_dim`, `mlp`, `vocab`, `layers`; see `refusion_jax.model.transformer`), batches use
`batch` and `length`, and the forward's activations `activation_*` names
(`refusion_jax.parallel.activations`). `LOGICAL_AXIS_RULES` maps each name to a mesh axis (or
several, or None for "replicated"); the config may replace the table. The
mesh has three axes:

- `data`:   pure data parallelism (parameters replicated);
- `fsdp`:   data parallelism with parameters and optimizer state sharded
            along `embed` (ZeRO-3 style);
- `tensor`: Megatron-style tensor parallelism over heads / MLP / vocab.

Training state and batches are placed with `NamedSharding`, and the jitted
train step receives matching in/out shardings; XLA inserts the collectives.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import flax.core.spmd
import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis name -> mesh axis (str), several mesh axes (tuple) or None (replicated).
LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
  ("batch", ("data", "fsdp")),
  ("length", None),
  ("embed", "fsdp"),
  ("vocab", "tensor"),
  ("heads", "tensor"),
  ("kv_heads", "tensor"),
  ("head_dim", None),
  ("mlp", "tensor"),
  ("layers", None),
  ("quant_groups", None),  # a quantized kernel's scales: one per input group (refusion_jax.model.quant)
  # The decode KV cache (refusion_jax.decoding.mesh): rows like the batch, entries whole on each device.
  ("cache_batch", ("data", "fsdp")),
  ("cache_length", None),
  # Activations (refusion_jax.parallel.activations): split like the batch, heads / MLP / vocab over `tensor`.
  ("activation_batch", ("data", "fsdp")),
  ("activation_length", None),
  ("activation_embed", None),
  ("activation_heads", "tensor"),
  ("activation_kv_heads", "tensor"),
  ("activation_head_dim", None),
  ("activation_mlp", "tensor"),
  ("activation_vocab", "tensor"),
)

Rules = Sequence[tuple[str, Any]]


def make_mesh(mesh_shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh with axes (`data`, `fsdp`, `tensor`) sized from `mesh_shape`.

  Args:
    mesh_shape: size per axis name; at most one axis may be -1, meaning "all
      remaining devices". Missing axes have size 1.
    devices: defaults to every device of every process.
  """
  devices = list(jax.devices() if devices is None else devices)
  unknown = set(mesh_shape) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"Unknown mesh axes {sorted(unknown)}; the mesh axes are {MESH_AXES}.")
  sizes = [int(mesh_shape.get(name, 1)) for name in MESH_AXES]
  if sizes.count(-1) > 1:
    raise ValueError(f"At most one mesh axis may be -1, got {dict(zip(MESH_AXES, sizes))}.")
  fixed = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % fixed:
      raise ValueError(
        f"Cannot fill the mesh {dict(zip(MESH_AXES, sizes))}: {len(devices)} devices are not a "
        f"multiple of the fixed axes' product {fixed}."
      )
    sizes[sizes.index(-1)] = len(devices) // fixed
  if math.prod(sizes) != len(devices):
    raise ValueError(
      f"The mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices but there are "
      f"{len(devices)}; set one axis to -1 to use all of them."
    )
  return jax.make_mesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules = LOGICAL_AXIS_RULES) -> PartitionSpec:
  """The `PartitionSpec` of an array whose dimensions carry `logical_axes`."""
  table = dict(rules)
  missing = [name for name in logical_axes if name is not None and name not in table]
  if missing:
    raise ValueError(
      f"Logical axes {missing} have no entry in the sharding rules {sorted(table)}; add them to config.sharding_rules."
    )
  return PartitionSpec(*(None if name is None else table[name] for name in logical_axes))


def state_shardings(state: Any, mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> Any:
  """`NamedSharding`s for a pytree of `nnx.Variable`s (model state, optimizer moments).

  Variables carry their logical axes as `out_sharding` metadata; plain arrays
  (optimizer step counts, RNG keys) are replicated.
  """
  names = {name for var in _variables(state) for name in (var.get_metadata().get("out_sharding") or ())}
  logical_to_spec(sorted(n for n in names if n), rules)  # fails early, naming any unmapped axis
  with flax.core.spmd.logical_axis_rules(tuple(rules)):
    specs = nnx.get_partition_spec(state)
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)


def batch_sharding(mesh: Mesh, rank: int, rules: Rules = LOGICAL_AXIS_RULES) -> NamedSharding:
  """Sharding of a [batch, length, ...] array (or [batch]) by the `batch` and `length` rules."""
  logical = ("batch", "length", *([None] * max(rank - 2, 0)))[:rank]
  return NamedSharding(mesh, logical_to_spec(logical, rules))


def batch_shardings(batch: Mapping[str, Any], mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> dict:
  """A sharding per batch entry ({"tokens": [B, L], "prompt_len": [B], ...})."""
  return {key: batch_sharding(mesh, np.ndim(value), rules) for key, value in batch.items()}


def shard_batch(batch: Mapping[str, np.ndarray], mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> dict:
  """Place this process's share of a global batch on the mesh.

  Every process passes its own rows (`per_process_batch = global / process_count`);
  on one process this is a plain `device_put`.
  """
  shardings = batch_shardings(batch, mesh, rules)
  if jax.process_count() == 1:
    return {key: jax.device_put(np.asarray(value), shardings[key]) for key, value in batch.items()}
  return {
    key: jax.make_array_from_process_local_data(shardings[key], np.asarray(value)) for key, value in batch.items()
  }


def batch_parallel_ways(mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> int:
  """How many ways the batch is split: the product of the mesh axes the `batch` rule names."""
  axes = dict(rules).get("batch")
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  return math.prod(mesh.shape[a] for a in axes)


def check_batch_split(
  global_batch: int, grad_accum_steps: int, mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES, processes: int | None = None
) -> None:
  """The global batch must split evenly over the batch-parallel devices, the processes and the microbatches.

  Under gradient accumulation each device splits its own rows into
  microbatches (strided, so that every device keeps its own rows in every
  microbatch and no row moves between devices), so each device's and each
  process's rows must be a multiple of `grad_accum_steps`.

  Args:
    processes: the processes feeding the batch (default: `jax.process_count()`).

  Raises:
    ValueError: naming the sizes and what to change.
  """
  ways = batch_parallel_ways(mesh, rules)
  processes = jax.process_count() if processes is None else processes
  split = math.lcm(ways, processes) * grad_accum_steps
  if global_batch % split:
    raise ValueError(
      f"batch_size={global_batch} must be a multiple of grad_accum_steps={grad_accum_steps} times the {ways} "
      f"batch-parallel devices (mesh axes {dict(rules).get('batch')} of {dict(mesh.shape)}) and the {processes} "
      "process(es), so that every device's rows split evenly into microbatches: change batch_size, "
      "grad_accum_steps or config.mesh."
    )


def _variables(tree: Any) -> list[nnx.Variable]:
  leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return [leaf for leaf in leaves if isinstance(leaf, nnx.Variable)]
