"""The one compiled decode loop and where it runs: the jitted `decode_loop`, and a `Loop` bound to one program.

Every decoding method runs in `decode_loop` (`batching.run_rows` over a
`batching.LoopState`, docs/method.md §3.3); a `Loop` fixes its static part (the
model's graph, the method's class and settings, the mesh) and places its inputs
the same way on every call, so new prompts never compile it again
(`compile_count` counts what XLA builds). The engine (`engine.py`) and the
ahead-of-time report (`training/aot_report.py`) both build theirs here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from refusion_jax.decoding.batching import LoopState, run_rows
from refusion_jax.decoding.compilations import compilations, tagged
from refusion_jax.decoding.contract import Decoder, Method, Settings
from refusion_jax.decoding.mesh import loop_shardings
from refusion_jax.model.config import ModelConfig
from refusion_jax.parallel.activations import activation_sharding, normalize_rules
from refusion_jax.parallel.hosts import default_device, place
from refusion_jax.parallel.sharding import LOGICAL_AXIS_RULES, Rules, state_shardings


@dataclasses.dataclass(frozen=True)
class LoopPlacement:
  """Where a decode loop runs: on `mesh`, split by the logical-axis `rules` (`refusion_jax.decoding.mesh`)."""

  mesh: jax.sharding.Mesh
  rules: Rules


def _decode_rows(
  graphdef: nnx.GraphDef,
  params: nnx.State,
  state: LoopState,
  max_iterations: jax.Array,
  knobs: Any,
  program: tuple[type[Method], Settings],
  placement: LoopPlacement | None,
) -> LoopState:
  """Run `program` = (method class, settings) over `state` (the body of every compiled decode loop); on a mesh
  (`placement`) the forwards carry their activation constraints and the state leaves with its shardings."""
  method, settings = program
  model = nnx.merge(graphdef, params)
  if placement is None:
    return run_rows(state, max_iterations, method, model, knobs, settings)
  with activation_sharding(placement.mesh, placement.rules):
    state = run_rows(state, max_iterations, method, model, knobs, settings)
  return jax.lax.with_sharding_constraint(state, loop_shardings(state, placement.mesh, placement.rules))


# decode_loop(graphdef, params, state, max_iterations, knobs, program=(method class, settings), placement) -> the
# LoopState after up to max_iterations iterations. Weights, the state, the iteration count and the knobs are traced:
# only the graph, the program, the placement, the shapes (rows, queue entries, prompt bucket) and the inputs'
# shardings compile anew, so `Loop` hands every input over placed the same way on every call. The state is donated:
# the returned state takes its buffers (the KV cache updated in place), so a caller holds one copy of it and must
# use only the returned state. The rest is kept: an engine passes the same weights, knobs and counts to every call.
decode_loop = jax.jit(_decode_rows, static_argnames=("graphdef", "program", "placement"), donate_argnames=("state",))

_LOOP_TAG = "decode_loop"


@dataclasses.dataclass(frozen=True)
class Loop:
  """`decode_loop` for one program and placement, as a function (params, state, max_iterations, knobs) -> LoopState.

  The inputs must reach the compiled program placed the same way on every call (on a mesh by the shardings of
  `refusion_jax.decoding.mesh`, else on the default device), so that the first call (host arrays) and a refill
  (the previous call's device arrays) compile once: their holder places the parameters, the knobs and the
  iteration count once (`place_params`, `place_replicated`) and the state before every call (`place_state`,
  which passes the leaves the previous call returned through untouched).
  """

  graphdef: nnx.GraphDef
  program: tuple[type[Method], Settings]
  placement: LoopPlacement | None = None

  def shardings(self, params: Any, state: LoopState) -> tuple[Any, LoopState, Any, Any]:
    """The shardings of (params, state, max_iterations, knobs); `params` and `state` may be abstract."""
    replicated = self._replicated()
    if self.placement is None:
      return replicated, replicated, replicated, replicated
    mesh, rules = self.placement.mesh, self.placement.rules
    return state_shardings(params, mesh, rules), self.state_shardings(state), replicated, replicated

  def state_shardings(self, state: LoopState) -> Any:
    """The shardings of the loop's state (a prefix of it: one sharding without a mesh)."""
    if self.placement is None:
      return self._replicated()
    return loop_shardings(state, self.placement.mesh, self.placement.rules)

  def _replicated(self) -> jax.sharding.Sharding:
    if self.placement is None:
      return jax.sharding.SingleDeviceSharding(default_device())
    return NamedSharding(self.placement.mesh, PartitionSpec())

  def place_params(self, params: nnx.State) -> nnx.State:
    """The parameters on their shardings (by their logical axes on a mesh), once per holder."""
    if self.placement is None:
      return place(params, self._replicated())
    return place(params, state_shardings(params, self.placement.mesh, self.placement.rules))

  def place_replicated(self, tree: Any) -> Any:
    """Knobs or an iteration count, replicated (on the default device without a mesh)."""
    return place(tree, self._replicated())

  def place_state(self, state: LoopState, shardings: Any = None) -> LoopState:
    """`state` on its shardings (`shardings`: `state_shardings(state)` kept by the caller)."""
    return place(state, self.state_shardings(state) if shardings is None else shardings)

  def __call__(self, params: Any, state: LoopState, max_iterations: Any, knobs: Any) -> LoopState:
    """One loop call on placed inputs; `state` is donated (its arrays are deleted): use the returned state."""
    name = self.program[0].name
    with tagged(_LOOP_TAG, f"{_LOOP_TAG}/{name}"):  # the loop's compiles
      return decode_loop(
        self.graphdef, params, state, max_iterations, knobs, program=self.program, placement=self.placement
      )

  def compile(self, params: Any, state: LoopState, max_iterations: Any, knobs: Any) -> None:
    """Compile the loop for these inputs without running it (`state` may be abstract, `jax.ShapeDtypeStruct`s
    carrying the shardings its placed arrays will have): a later call on inputs placed so compiles nothing, and
    the compilations of several loops may run on threads at once."""
    with tagged(_LOOP_TAG, f"{_LOOP_TAG}/{self.program[0].name}"):
      self.lower(params, state, max_iterations, knobs).compile()

  def lower(self, params: Any, state: LoopState, max_iterations: Any, knobs: Any) -> jax.stages.Lowered:
    """The loop lowered for abstract inputs (`jax.ShapeDtypeStruct`s carrying their shardings)."""
    return decode_loop.lower(
      self.graphdef, params, state, max_iterations, knobs, program=self.program, placement=self.placement
    )


def compile_count(method: str | None = None) -> int:
  """XLA compilations of the decode loop for one method (`Method.name`: "refusion", "ar", "mdm"), or of all
  its calls, as JAX reports them (`refusion_jax.decoding.compilations`)."""
  return compilations(_LOOP_TAG if method is None else f"{_LOOP_TAG}/{method}")


def loop_for(
  decoder: Decoder, graphdef: nnx.GraphDef, mesh: jax.sharding.Mesh | None = None, rules: Rules = LOGICAL_AXIS_RULES
) -> Loop:
  """`decoder`'s compiled loop, on `mesh` or the default device, as an `Engine` runs it."""
  placement = None if mesh is None else LoopPlacement(mesh, normalize_rules(rules))
  return Loop(graphdef, (type(decoder.method), decoder.settings), placement)


def start_state(decoder: Decoder, config: ModelConfig, rows: int, prompt_width: int) -> LoopState:
  """K = `rows` idle rows before an empty queue, for prompts padded to `prompt_width` (host arrays only)."""
  row_state, widths = decoder.method.start_rows(decoder.settings, config, rows, prompt_width)
  return LoopState.create(row_state, widths, prompt_width, decoder.settings.gen_length)
