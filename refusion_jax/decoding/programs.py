"""The process-wide caches of decoding: placed programs per model and idle start states, and how to clear them.

Building an `Engine` costs two things a later engine of the same model and
method need not pay again: placing the parameters and knobs of its `Loop`
(splitting the model, copying weights to devices) and building and placing
its idle start state. Both are cached here for the life of the process.

Policy:
  * placed programs are kept per model, weakly: they go with the model, and
    are valid only while the model's structure and arrays are the very ones
    they were placed from (an update replaces arrays, so it is noticed);
    at most `PROGRAMS_PER_MODEL` per model, oldest first out; a program whose
    parameters had to be copied to reach their devices (a mesh, another
    device) is never kept, so the cache never holds a second copy of the weights;
  * idle start states are kept on the host, and only while small
    (`START_BYTES`, at most `STARTS_KEPT`): the loop donates its state, so a
    placed one would serve a single engine (each engine's first call places
    its own), and a big model's idle KV caches would hold memory between calls.
`clear_caches()` (`rj.clear_caches`) drops both (e.g. before measuring memory, or after changing the
default device).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import jax
from flax import nnx

from refusion_jax.decoding.batching import LoopState
from refusion_jax.decoding.contract import Decoder
from refusion_jax.decoding.loop import Loop, loop_for, start_state
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer
from refusion_jax.parallel.activations import normalize_rules
from refusion_jax.parallel.sharding import Rules


@dataclasses.dataclass(frozen=True)
class PlacedProgram:
  """What an engine places once: its compiled loop, the parameters and the knobs on their devices, and the
  iteration counts `advance` has placed (by count)."""

  loop: Loop
  params: nnx.State
  knobs: Any
  chunks: dict[int | None, Any]


@dataclasses.dataclass
class _ModelPrograms:
  """The placed programs of one model, valid while its structure and arrays are the very ones they were placed
  from (`jax.tree.flatten` of the model: its modules and variables as a tree definition, its arrays as leaves)."""

  treedef: Any
  leaves: list[Any]
  programs: dict[tuple, PlacedProgram]

  def holds(self, treedef: Any, leaves: list[Any]) -> bool:
    return (
      len(leaves) == len(self.leaves) and all(a is b for a, b in zip(leaves, self.leaves)) and treedef == self.treedef
    )


# Placed programs by model, dropped with the model. An engine built for a model whose arrays are unchanged (arrays
# are immutable: an update replaces them) reuses its loop, parameters and knobs, so a `decode` call places and splits
# nothing it placed before: a model is a pytree, and flattening it to check costs a tenth of `nnx.split`. Only
# programs whose parameters were already where the loop needs them are kept (the common one-device case), so an
# entry never holds a second copy of the weights.
_PROGRAMS: weakref.WeakKeyDictionary[Transformer, _ModelPrograms] = weakref.WeakKeyDictionary()
PROGRAMS_PER_MODEL = 16


def placed_program(
  model: Transformer, decoder: Decoder, mesh: jax.sharding.Mesh | None, rules: Rules, key: tuple
) -> PlacedProgram:
  """The loop of `decoder` for `model` on `mesh`, with its parameters and knobs placed (`key`: what fixes the
  knobs and the program besides the placement: the method value, the special ids, whether it samples)."""
  leaves, treedef = jax.tree.flatten(model)
  key = (key, mesh, None if mesh is None else normalize_rules(rules))
  cached = _PROGRAMS.get(model)
  if cached is not None and cached.holds(treedef, leaves) and key in cached.programs:
    return cached.programs[key]
  graphdef, params = nnx.split(model)
  loop = loop_for(decoder, graphdef, mesh, rules)
  placed = PlacedProgram(loop, loop.place_params(params), loop.place_replicated(decoder.knobs), {})
  param_leaves = jax.tree.leaves(params)
  if all(a is b for a, b in zip(jax.tree.leaves(placed.params), param_leaves)):
    if cached is None or not cached.holds(treedef, leaves):
      cached = _PROGRAMS[model] = _ModelPrograms(treedef, leaves, {})
    if len(cached.programs) >= PROGRAMS_PER_MODEL:
      cached.programs.pop(next(iter(cached.programs)))
    cached.programs[key] = placed
  return placed


@dataclasses.dataclass(frozen=True)
class StartState:
  """An engine's idle start state on the host (the engine's copy of the queue is made from it, and its first loop
  call places it), and the shardings of the state, whose structure never changes."""

  host: LoopState
  shardings: Any


# Idle start states by everything that fixes them, on the host: the loop donates its state, so a placed one would
# serve one engine only.
_STARTS: dict[tuple, StartState] = {}
STARTS_KEPT, START_BYTES = 8, 64 * 2**20


def start_for(loop: Loop, decoder: Decoder, config: ModelConfig, rows: int, prompt_width: int) -> StartState:
  """The idle start state of `loop` for K = `rows` rows and prompt bucket `prompt_width` (cached while small)."""
  key = (loop.program, loop.placement, config, rows, prompt_width, jax.config.jax_default_prng_impl)
  if key in _STARTS:
    return _STARTS[key]
  host = start_state(decoder, config, rows, prompt_width)
  start = StartState(host, loop.state_shardings(host))
  if sum(leaf.nbytes for leaf in jax.tree.leaves(host)) <= START_BYTES:  # a big model's caches are not kept idle
    if len(_STARTS) >= STARTS_KEPT:
      _STARTS.pop(next(iter(_STARTS)))
    _STARTS[key] = start
  return start


def clear_caches() -> None:
  """Drop every cached placed program and idle start state (their device memory is freed with them)."""
  _PROGRAMS.clear()
  _STARTS.clear()
