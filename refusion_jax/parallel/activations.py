"""Sharding constraints on activations, by logical axis name (docs/method.md §5).

Parameters carry logical axes, but nothing in a jitted step says how the
activations between them are laid out, and XLA's sharding propagation then
lets the parameters' `embed` split (FSDP) flow into the residual stream: each
chip ends up holding every row of the global batch split along `embed`, and
the logits of the whole batch. The forward therefore pins its activations
with `constrain(x, ("activation_batch", "activation_length", ...))`, mapped
to mesh axes by the same rules table as the parameters
(`refusion_jax.parallel.sharding.LOGICAL_AXIS_RULES`): activations split like
the batch, so per-chip memory falls as chips are added.

The constraints apply only while a function is traced under
`activation_sharding(mesh, rules)` (wrap it with `sharded_activations` before
`jax.jit`); everywhere else, one device included, `constrain` is the identity.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from refusion_jax.parallel.sharding import LOGICAL_AXIS_RULES, Rules, logical_to_spec

# The (mesh, rules) of the function being traced, or None.
_ACTIVE: contextvars.ContextVar[tuple[Mesh, tuple] | None] = contextvars.ContextVar("activation_sharding", default=None)


def normalize_rules(rules: Rules) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
  """The rules as hashable tuples (config files may hand over lists)."""
  return tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in rules)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> Iterator[None]:
  """Within this context, `constrain` pins activations to `mesh` by `rules` (trace time only)."""
  token = _ACTIVE.set((mesh, normalize_rules(rules)))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def sharded_activations(fn: Callable, mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> Callable:
  """`fn` traced under `activation_sharding(mesh, rules)`; jit the result (`jax.jit(sharded_activations(f, ...))`).

  The context is entered inside the traced function, so every trace of the
  jitted function, whenever it happens, carries the constraints.
  """

  @functools.wraps(fn)
  def traced_with_constraints(*args, **kwargs):
    with activation_sharding(mesh, rules):
      return fn(*args, **kwargs)

  return traced_with_constraints


def active_mesh() -> Mesh | None:
  """The mesh of the function being traced under `activation_sharding`, or None."""
  active = _ACTIVE.get()
  return None if active is None else active[0]


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """`x` constrained to the sharding its logical axes map to; the identity outside `activation_sharding`.

  A dimension that the mapped mesh axes do not divide (batch 1 on 8 chips, 8
  KV heads on 16 tensor ways) is replicated instead of failing.
  """
  layout = active_layout(logical_axes, x.shape)
  if layout is None:
    return x
  return jax.lax.with_sharding_constraint(x, NamedSharding(*layout))


def active_layout(logical_axes: Sequence[str | None], shape: Sequence[int]) -> tuple[Mesh, PartitionSpec] | None:
  """The mesh and spec `constrain` pins an array of `shape` to; None outside `activation_sharding`.

  For code that must place a computation by hand (a `shard_map`), with the
  same replication of dimensions that the mapped mesh axes do not divide.
  """
  active = _ACTIVE.get()
  if active is None:
    return None
  mesh, rules = active
  if len(logical_axes) != len(shape):
    raise ValueError(f"{len(logical_axes)} logical axes {tuple(logical_axes)} for an array of shape {tuple(shape)}.")
  return mesh, _dividing(logical_to_spec(logical_axes, rules), tuple(shape), mesh)


def _dividing(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
  """`spec` with every entry whose mesh axes do not divide its dimension replaced by None."""

  def ways(axes) -> int:
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes)

  return PartitionSpec(*(axes if size % ways(axes) == 0 else None for axes, size in zip(spec, shape)))
