"""Filling an abstract model from stored arrays, each placed straight onto its target sharding.

Every format reader hands over the same things (a `Source`): its stored arrays,
the `mapping.Table` that matches them to our parameters, and a `Fetch` that
reads named stored arrays onto given shardings (orbax restores them shard by
shard; safetensors are read one tensor at a time). `build_model` checks that
they fit the config (`mapping.check_fit`) and `fill`

- restores arrays already in our layout straight into the parameters'
  shardings and dtype, largest first, in groups of a quarter of the largest
  array (a reader briefly holds about twice what it reads);
- fetches every other array alone, sharded by the logical axes of the
  parameter it becomes, converts it on the devices (a jitted transpose,
  reshape, un-stacking of scanned layers...) into the target sharding, waits
  for the conversion and drops the stored copy before the next read.

So the host holds at most the model plus about two of its largest arrays
(tests/helpers/memory_probe.py measures it), and no array is gathered onto one device.

A float checkpoint read into a quantized config (`load_model(..., quantize="int8")`)
is filled into the float model's targets, and every projection kernel is
quantized on the devices as soon as its group is read (`quantizer`): the devices
hold the quantized model plus one group of float arrays, never the float model.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from refusion_jax.checkpoints.mapping import Entry, Table, check_fit, disagreements, infer_fields
from refusion_jax.model import quant
from refusion_jax.model.adapter import TARGETS
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer, abstract_model
from refusion_jax.parallel import sharding as sharding_lib

# Reads the named stored arrays onto the given (shape, dtype, sharding) targets, in order.
Fetch = Callable[[Sequence[tuple[str, jax.ShapeDtypeStruct]]], list[jax.Array]]


@dataclasses.dataclass(frozen=True)
class Source:
  """A checkpoint opened for reading: what it stores and how to read it.

  Attributes:
    format: "hf", "refusion", "tunix" or "maxtext".
    location: what was found, for messages ("tunix checkpoint, step 5 in /runs/x").
    arrays: {stored name: (shape, dtype)} of the arrays that hold parameters.
    table: how stored names map to our parameters.
    fetch: reads named stored arrays onto target shardings.
    config: the model config the checkpoint stores itself (None for tunix / MaxText).
    where: a prefix locating a stored array in messages (its file).
  """

  format: str
  location: str
  arrays: dict[str, tuple[tuple[int, ...], Any]]
  table: Table
  fetch: Fetch
  config: ModelConfig | None = None
  where: Callable[[str], str] = lambda name: ""


def dotted(path: tuple) -> str:
  return ".".join(str(part) for part in path)


def _rules(rules: sharding_lib.Rules | None) -> sharding_lib.Rules:
  return tuple(rules) if rules is not None else sharding_lib.LOGICAL_AXIS_RULES


def abstract_targets(
  config: ModelConfig, mesh: Mesh | None = None, rules: sharding_lib.Rules | None = None
) -> tuple[nnx.GraphDef, dict[str, jax.ShapeDtypeStruct]]:
  """The model's graphdef and, per dotted parameter path, its shape, dtype and target sharding.

  Without a mesh every parameter goes to the default device.
  """
  graphdef, state = abstract_model(config)
  if mesh is None:
    device = SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, state)
  else:
    shardings = sharding_lib.state_shardings(state, mesh, _rules(rules))
  flat = dict(nnx.to_flat_state(state))
  flat_shardings = dict(nnx.to_flat_state(shardings))
  targets = {
    dotted(path): jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=_leaf(flat_shardings[path]))
    for path, v in flat.items()
  }
  return graphdef, targets


def _leaf(value: Any) -> Any:
  return value.get_value() if isinstance(value, nnx.Variable) else value


def merge(graphdef: nnx.GraphDef, config: ModelConfig, values: dict[str, jax.Array]) -> Transformer:
  """The model with every parameter taken from `values` (dotted path -> array)."""
  _, state = abstract_model(config)
  filled = [(path, variable.replace(values[dotted(path)])) for path, variable in nnx.to_flat_state(state)]
  return nnx.merge(graphdef, nnx.from_flat_state(filled))


def stored_sharding(entry: Entry, target: jax.ShapeDtypeStruct, mesh: Mesh | None, rules) -> Sharding:
  """Where a stored array that is not in our layout yet is placed: by the logical axes its stored axes
  carry (a fused "heads*head_dim" axis split like `heads`), replicated along axes that do not divide."""
  if mesh is None:
    return target.sharding
  table = dict(rules)
  spec = []
  for axis, size in zip(entry.rule.stored_axes, entry.shape):
    logical = {"padded_vocab": "vocab"}.get(axis, axis.split("*")[0])
    mesh_axes = table.get(logical)
    names = () if mesh_axes is None else (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    ways = 1
    for name in names:
      ways *= mesh.shape[name]
    spec.append(mesh_axes if names and size % ways == 0 else None)
  return NamedSharding(mesh, PartitionSpec(*spec))


@functools.cache
def _converter(convert, shapes: tuple, dtype, stack_axis: int | None, out_shardings: tuple) -> Callable:
  """A jitted stored -> ours conversion (one output per layer for a scanned stack), cached per signature."""

  def run(x):
    if stack_axis is None:
      return (convert(x, shapes[0]).astype(dtype),)
    return tuple(convert(jnp.take(x, i, axis=stack_axis), shape).astype(dtype) for i, shape in enumerate(shapes))

  return jax.jit(run, out_shardings=out_shardings)


def _unpad(x, shape):
  """The leading `shape` block of x: the same layout, possibly padded (MaxText's rounded-up vocabulary)."""
  return x[tuple(slice(0, size) for size in shape)]


def _nbytes(target: jax.ShapeDtypeStruct) -> int:
  return quant.stored_bytes(target.shape, target.dtype)


def _batches(entries: Sequence[Entry], targets: dict[str, jax.ShapeDtypeStruct]) -> list[list[Entry]]:
  """Groups for one fetch each, largest arrays first, each group at most a quarter of the largest array's bytes
  (or that array alone). A reader holds about twice a group while it reads, so the host peaks with the largest
  arrays, while the model is still small, and never above the model plus twice the largest array."""
  ordered = sorted(entries, key=lambda e: -_nbytes(targets[e.ours[0]]))
  limit = max((_nbytes(targets[e.ours[0]]) for e in ordered), default=0) // 4
  batches: list[list[Entry]] = []
  total = limit + 1
  for entry in ordered:
    size = _nbytes(targets[entry.ours[0]])
    if total + size > limit:
      batches.append([])
      total = 0
    batches[-1].append(entry)
    total += size
  return batches


def fill(
  entries: Sequence[Entry],
  targets: dict[str, jax.ShapeDtypeStruct],
  fetch: Fetch,
  mesh: Mesh | None = None,
  rules: sharding_lib.Rules | None = None,
  finish: Callable[[dict[str, jax.Array]], dict[str, jax.Array]] = lambda values: values,
) -> dict[str, jax.Array]:
  """Every target parameter, from `entries` (which must cover the targets exactly; see `check`).

  `finish` turns each group of parameters as soon as they are read (e.g. quantizes them, `quantizer`), so
  what the reads hold at once is one group, never the whole model.
  """
  rules = _rules(rules)
  values: dict[str, jax.Array] = {}
  direct = [e for e in entries if e.rule.to_ours is None and not e.rule.stacked and e.shape == targets[e.ours[0]].shape]
  for batch in _batches(direct, targets):
    restored = jax.block_until_ready(fetch([(e.name, targets[e.ours[0]]) for e in batch]))
    values.update(jax.block_until_ready(finish({e.ours[0]: array for e, array in zip(batch, restored)})))
  for entry in sorted(entries, key=lambda e: -math.prod(e.shape) * np.dtype(e.dtype).itemsize):
    if entry.ours[0] in values:
      continue
    first = targets[entry.ours[0]]
    stored = jax.ShapeDtypeStruct(entry.shape, entry.dtype, sharding=stored_sharding(entry, first, mesh, rules))
    (array,) = fetch([(entry.name, stored)])
    outs = [targets[path] for path in entry.ours]
    stack_axis = entry.rule.stored_axes.index("layers") if entry.rule.stacked else None
    convert = _converter(
      entry.rule.to_ours or _unpad,
      tuple(t.shape for t in outs),
      first.dtype,
      stack_axis,
      tuple(t.sharding for t in outs),
    )
    converted = jax.block_until_ready(convert(array))
    del array  # the stored copy goes (the conversion having run, not just been dispatched) before the next read
    values.update(jax.block_until_ready(finish(dict(zip(entry.ours, converted)))))
  return values


def quantizer(config: ModelConfig, targets: dict[str, jax.ShapeDtypeStruct]) -> Callable[[dict], dict]:
  """A `fill` finish that turns every float projection kernel it is given into its integer kernel and scale
  (`config.quantize`), placed on their `targets` (the quantized model's) shardings; other arrays pass."""

  def finish(values: dict[str, jax.Array]) -> dict[str, jax.Array]:
    out = {}
    for path, value in values.items():
      scale_path = path + quant.SCALE_SUFFIX
      if scale_path not in targets:
        out[path] = value
        continue
      inputs = TARGETS[path.rsplit(".", 1)[1]][1]
      convert = _quantize_converter(
        inputs, config.quantize, config.quantize_group_size, targets[path].sharding, targets[scale_path].sharding
      )
      out[path], out[scale_path] = convert(value)
    return out

  return finish


@functools.cache
def _quantize_converter(inputs: int, mode: str, group_size: int, kernel_sharding, scale_sharding) -> Callable:
  """A jitted float kernel -> (integer kernel, scale), cached per signature."""
  quantize = functools.partial(quant.quantize_kernel, inputs=inputs, mode=mode, group_size=group_size)
  return jax.jit(quantize, out_shardings=(kernel_sharding, scale_sharding))


def check_config(source: Source, config: ModelConfig) -> None:
  """Refuse a config that contradicts what the stored arrays determine, naming every such field."""
  entries, _ = source.table.entries(source.arrays)
  problems = disagreements(config, infer_fields(entries))
  if problems:
    raise ValueError(
      f"The config disagrees with the arrays of the {source.location}: {'; '.join(problems)}. "
      "Pass the config of the model this checkpoint was trained from."
    )


def build_model(
  source: Source, config: ModelConfig, mesh: Mesh | None = None, rules: sharding_lib.Rules | None = None
) -> Transformer:
  """The model of `config` with every parameter read from `source` onto its sharding on `mesh`.

  Raises:
    ValueError: a stored array does not fit `config` (see `mapping.check_fit`).
  """
  entries, unknown = source.table.entries(source.arrays)
  graphdef, targets = abstract_targets(config, mesh, rules)
  stored_quantized = source.config is not None and source.config.quantize != "none"
  if config.quantize == "none" or stored_quantized:
    check_fit(entries, unknown, source.table, config, {path: t.shape for path, t in targets.items()}, source.where)
    return merge(graphdef, config, fill(entries, targets, source.fetch, mesh, rules))
  # Float arrays read into a quantized model: each kernel is quantized on the devices as soon as it is read.
  float_config = config.replace(quantize="none")
  _, float_targets = abstract_targets(float_config, mesh, rules)
  shapes = {path: t.shape for path, t in float_targets.items()}
  check_fit(entries, unknown, source.table, float_config, shapes, source.where)
  values = fill(entries, float_targets, source.fetch, mesh, rules, finish=quantizer(config, targets))
  return merge(graphdef, config, values)
