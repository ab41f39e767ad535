"""The host side of every jitted decoder: the one compiled loop, and the driver around it.

A decoding method (ReFusion, AR, MDM) is a `contract.Method`: how to start
idle rows, how to admit a prompt into a row, how to step every row. `decode_loop` is the
one jitted loop that runs any of them over a `batching.LoopState`, counted by
`compile_count`; `run_decoder` is the one front end every `*_generate` ends
in: check, pad into a prompt bucket, feed the queue from the host in chunks,
read the answers back (docs/method.md §3.3, §3.4).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from refusion_jax.decoding.batching import DecodeOutputs, LoopState, run_rows
from refusion_jax.decoding.checks import check_positive, check_prompts, check_special_id, decoder_special_tokens
from refusion_jax.decoding.compilations import compilations, tagged
from refusion_jax.decoding.contract import Method, Settings
from refusion_jax.decoding.mesh import loop_shardings
from refusion_jax.decoding.prompts import pad_prompts
from refusion_jax.decoding.result import PHASE_NONE, DecodeResult
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer, inference_view
from refusion_jax.parallel.activations import activation_sharding, normalize_rules
from refusion_jax.parallel.sharding import LOGICAL_AXIS_RULES, Rules, batch_parallel_ways, state_shardings


@dataclasses.dataclass(frozen=True)
class Decoder:
  """One decode call's method with its checked knobs.

  Attributes:
    method: the `Method`.
    settings: what fixes the compiled program (static and hashable; has `gen_length`, G).
    knobs: the traced knobs (a pytree of arrays: thresholds, PRNG key, ids).
    eos_id: the checked stop id answers are cut after (`checks.NO_TOKEN`: none).
  """

  method: Method
  settings: Settings
  knobs: Any
  eos_id: int


def _decode_rows(
  graphdef: nnx.GraphDef,
  params: nnx.State,
  batch: LoopState,
  max_iterations: jax.Array,
  knobs: Any,
  program: tuple[Method, Settings],
  placement: Placement | None,
) -> LoopState:
  """Run `program` = (method, settings) over `batch` (the body of every compiled decode loop); on a mesh
  (`placement`) the forwards carry their activation constraints and the batch leaves with its shardings."""
  method, settings = program
  model = nnx.merge(graphdef, params)
  if placement is None:
    return run_rows(batch, max_iterations, method, model, knobs, settings)
  with activation_sharding(placement.mesh, placement.rules):
    batch = run_rows(batch, max_iterations, method, model, knobs, settings)
  return jax.lax.with_sharding_constraint(batch, loop_shardings(batch, placement.mesh, placement.rules))


# decode_loop(graphdef, params, batch, max_iterations, knobs, program=(method, settings), placement) -> the LoopState
# after up to max_iterations iterations. Weights, the batch, the iteration count and the knobs are traced: only the
# graph, the program, the placement, the shapes (rows, queue entries, prompt bucket) and the inputs' shardings
# compile anew, so `Loop` hands every input over placed the same way on every call.
decode_loop = jax.jit(_decode_rows, static_argnames=("graphdef", "program", "placement"))


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a decode loop runs: on `mesh`, split by the logical-axis `rules` (`refusion_jax.decoding.mesh`)."""

  mesh: jax.sharding.Mesh
  rules: Rules


@dataclasses.dataclass(frozen=True)
class Loop:
  """`decode_loop` for one program and placement, as a function (params, batch, max_iterations, knobs) -> LoopState.

  Every call places every input explicitly first: on a mesh by the shardings of `refusion_jax.decoding.mesh`,
  else on the default device. So the compiled program sees the same input shardings on the first call
  (host arrays) and on a refill (the previous call's device arrays), and compiles once.
  """

  graphdef: nnx.GraphDef
  program: tuple[Method, Settings]
  placement: Placement | None = None

  def shardings(self, params: Any, batch: LoopState) -> tuple[Any, LoopState, Any, Any]:
    """The shardings of (params, batch, max_iterations, knobs); `params` and `batch` may be abstract."""
    if self.placement is None:
      device = jax.sharding.SingleDeviceSharding(_default_device())
      return device, device, device, device
    mesh, rules = self.placement.mesh, self.placement.rules
    replicated = NamedSharding(mesh, PartitionSpec())
    return state_shardings(params, mesh, rules), loop_shardings(batch, mesh, rules), replicated, replicated

  def __call__(self, params: Any, batch: LoopState, max_iterations: Any, knobs: Any) -> LoopState:
    placed = _place((params, batch, max_iterations, knobs), self.shardings(params, batch))
    name = self.program[0].name
    with tagged(_LOOP_TAG, f"{_LOOP_TAG}/{name}"):  # the loop's compiles, not those of placing its inputs
      return decode_loop(self.graphdef, *placed, program=self.program, placement=self.placement)

  def lower(self, params: Any, batch: LoopState, max_iterations: Any, knobs: Any) -> jax.stages.Lowered:
    """The loop lowered for abstract inputs (`jax.ShapeDtypeStruct`s carrying their shardings)."""
    return decode_loop.lower(
      self.graphdef, params, batch, max_iterations, knobs, program=self.program, placement=self.placement
    )


def _place(values: Any, shardings: Any) -> Any:
  """`values` on `shardings` (a prefix tree of them), every leaf placed the same way on every call.

  Within one process `jax.device_put` does it all. On a mesh that spans processes, a value this process holds
  whole (host arrays, knobs: the same in every process) is assembled shard by shard from it, and an array spread
  over the processes in another layout (the training state, when a multi-process run evaluates) is resharded by
  one compiled identity, whose collectives every backend has, where `device_put` would need cross-host
  transfers that some backends lack.
  """
  flat_shardings = jax.tree.leaves(shardings)
  subtrees = jax.tree.structure(shardings).flatten_up_to(values)
  pairs = [(leaf, sharding) for subtree, sharding in zip(subtrees, flat_shardings) for leaf in jax.tree.leaves(subtree)]
  placed, across = [], []
  for i, (leaf, sharding) in enumerate(pairs):
    if sharding.is_fully_addressable or (isinstance(leaf, jax.Array) and leaf.sharding == sharding):
      placed.append(jax.device_put(leaf, sharding))
    elif not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
      placed.append(_assembled(leaf, sharding))
    else:
      placed.append(leaf)
      across.append(i)
  if across:
    moved = jax.jit(_same, out_shardings=[pairs[i][1] for i in across])([pairs[i][0] for i in across])
    for i, leaf in zip(across, moved):
      placed[i] = leaf
  return jax.tree.unflatten(jax.tree.structure(values), placed)


def _assembled(leaf: Any, sharding: jax.sharding.Sharding) -> jax.Array:
  """A value every process holds whole, as one array over `sharding`'s devices in all processes."""
  if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    data = _assembled(jax.random.key_data(leaf), sharding)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
  whole = np.asarray(leaf)
  return jax.make_array_from_callback(whole.shape, sharding, lambda index: whole[index])


def _to_host(values: Any) -> Any:
  """`values` as host arrays, whole in every process (rows split over processes are gathered)."""

  def fetch(leaf: Any) -> Any:
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return jax.device_get(leaf)

  return jax.tree.map(fetch, values)


def _same(leaves: list[jax.Array]) -> list[jax.Array]:
  return leaves


def _default_device() -> jax.Device:
  """Where jitted work runs without a mesh: `jax.default_device` where set, else the first device."""
  default = jax.config.jax_default_device
  if isinstance(default, str):  # a platform name
    return jax.devices(default)[0]
  return default or jax.devices()[0]


def compile_count(method: str | None = None) -> int:
  """XLA compilations of the decode loop for one method (`Method.name`: "refusion", "ar", "mdm"), or of all
  its calls, as JAX reports them (`refusion_jax.decoding.compilations`)."""
  return compilations(_LOOP_TAG if method is None else f"{_LOOP_TAG}/{method}")


_LOOP_TAG = "decode_loop"


def padded_rows(rows: int, mesh: jax.sharding.Mesh | None, rules=LOGICAL_AXIS_RULES) -> int:
  """`rows` rounded up to a multiple of the mesh's batch-parallel ways (the extra rows stay idle)."""
  ways = 1 if mesh is None else batch_parallel_ways(mesh, rules)
  return -(-rows // ways) * ways


def loop_for(
  decoder: Decoder, graphdef: nnx.GraphDef, mesh: jax.sharding.Mesh | None = None, rules=LOGICAL_AXIS_RULES
) -> Loop:
  """`decoder`'s compiled loop, on `mesh` or the default device, as `run_decoder` runs it."""
  placement = None if mesh is None else Placement(mesh, normalize_rules(rules))
  return Loop(graphdef, (decoder.method, decoder.settings), placement)


def start_batch(decoder: Decoder, config: ModelConfig, rows: int, prompt_width: int) -> LoopState:
  """K = `rows` idle rows before an empty queue, for prompts padded to `prompt_width` (host arrays only)."""
  row_state, widths = decoder.method.start_rows(decoder.settings, config, rows, prompt_width)
  return LoopState.create(row_state, widths, prompt_width, decoder.settings.gen_length)


class _Feed:
  """The host's side of the queue: which prompt each entry holds, the next prompt, the outputs read back."""

  def __init__(self, tokens: np.ndarray, lengths: np.ndarray, batch: LoopState):
    self.tokens, self.lengths = tokens, lengths
    self.queue_tokens = np.array(batch.queue_tokens)
    self.queue_lengths = np.array(batch.queue_lengths)
    self.queue_prompt = np.array(batch.queue_prompt)
    self.held = np.full(self.queue_prompt.shape, -1)  # the prompt each entry holds, -1 where free
    self.queued = 0  # prompts handed to the loop so far (in input order)
    gen_length = batch.out.answer.shape[1]
    self.results = DecodeOutputs.empty(len(tokens), gen_length)
    self.left = len(tokens)  # prompts whose outputs are not read back yet

  def refill(self, batch: LoopState, waiting: np.ndarray, out: DecodeOutputs) -> LoopState:
    """`batch` with its free entries holding the next prompts (waiting, outputs reset)."""
    free = np.flatnonzero(self.held < 0)[: len(self.tokens) - self.queued]
    prompts = np.arange(self.queued, self.queued + len(free))
    self.queued += len(free)
    self.held[free] = prompts
    self.queue_tokens[free], self.queue_lengths[free], self.queue_prompt[free] = (
      self.tokens[prompts],
      self.lengths[prompts],
      prompts,
    )
    waiting = np.array(waiting)
    waiting[free] = True
    empty = DecodeOutputs.empty(1, out.answer.shape[1])

    def reset(field: np.ndarray, blank: np.ndarray) -> np.ndarray:
      field = np.array(field)
      field[free] = blank
      return field

    # Copies: a CPU device may keep using the host buffer it was given, which the next refill writes.
    return batch.replace(
      queue_tokens=self.queue_tokens.copy(),
      queue_lengths=self.queue_lengths.copy(),
      queue_prompt=self.queue_prompt.copy(),
      waiting=waiting,
      more=np.bool_(self.queued < len(self.tokens)),
      out=jax.tree.map(reset, out, empty),
    )

  def collect(self, batch: LoopState) -> LoopState:
    """Read back the entries whose prompt finished, then refill them (`batch` after a loop call)."""
    busy, entry, waiting, out = _to_host((batch.busy, batch.entry, batch.waiting, batch.out))
    decoding = np.zeros(self.held.shape, bool)
    decoding[entry[busy]] = True
    done = np.flatnonzero((self.held >= 0) & ~waiting & ~decoding)
    for field, read in zip(jax.tree.leaves(self.results), jax.tree.leaves(out)):
      field[self.held[done]] = read[done]
    self.held[done] = -1
    self.left -= len(done)
    return self.refill(batch, waiting, out) if self.left else batch


def run_decoder(
  model: Transformer,
  prompt_ids: Sequence[Sequence[int]],
  decoder: Decoder,
  *,
  pad_id: int | None,
  mesh: jax.sharding.Mesh | None = None,
  batch_size: int | None = None,
  chunk_iterations: int | None = None,
) -> DecodeResult:
  """The host side of every jitted decoder: check, pad, feed the rows, run the loop, read the answers back.

  The loop keeps K rows busy over a queue of `batching.queue_entries(K)`
  entries that this side refills between calls, so the compiled program
  depends on K, the prompt bucket and the settings, never on how many prompts
  there are (docs/method.md §3.4).

  Args:
    prompt_ids: N prompts of integer token ids, any lengths (padded into one bucket).
    pad_id: prompt padding id (never attended); None: the config's pad, else its EOS, else 0.
    mesh: decode on this mesh (`refusion_jax.make_mesh`): rows split over its batch-parallel axes (their
      count padded to a multiple of its batch-parallel devices; padded rows stay idle), parameters and
      cache by their logical axes (`refusion_jax.decoding.mesh`); None: the default device.
    batch_size: K rows kept busy (continuous batching: a finished row takes the
      next prompt), one compiled program whatever N is; None: all N prompts as one batch (K = N).
    chunk_iterations: run the compiled loop at most this many iterations per call (state in, state out),
      as a server drives it, with the same results; None: each call runs until the queue needs refilling.

  Returns:
    A `DecodeResult` in input order whose trace is blanked past each answer;
    seconds covers padding, the loop (and its compilation, when it happens)
    and the read-back.
  """
  config = model.config
  check_prompts(prompt_ids, config, decoder.settings.gen_length)
  pad = check_special_id("pad_id", decoder_special_tokens(config, pad_id=pad_id).pad, config)
  check_positive("batch_size", batch_size, "all prompts as one batch")
  check_positive("chunk_iterations", chunk_iterations, "run the loop to the end in one call")
  model = inference_view(model)  # every decoder runs without remat, on weights cast once (docs/method.md §5)
  rows = padded_rows(batch_size or len(prompt_ids), mesh)
  start = time.perf_counter()
  tokens, lengths = pad_prompts(prompt_ids, pad)
  batch = start_batch(decoder, config, rows, tokens.shape[1])
  feed = _Feed(tokens, lengths, batch)
  batch = feed.refill(batch, batch.waiting, batch.out)
  graphdef, params = nnx.split(model)
  loop = loop_for(decoder, graphdef, mesh)
  iterations = np.int32(chunk_iterations or np.iinfo(np.int32).max)
  while feed.left:
    batch = feed.collect(loop(params, batch, iterations, decoder.knobs))
  widths = _to_host(batch.widths)
  seconds = time.perf_counter() - start
  out = feed.results
  answers = [row[: row.index(decoder.eos_id) + 1] if decoder.eos_id in row else row for row in out.answer.tolist()]
  # Past each answer nothing counts as committed (a slot after the EOS may have been).
  answered = np.arange(out.answer.shape[1])[None, :] < np.array([len(a) for a in answers])[:, None]
  return DecodeResult(
    tokens=answers,
    num_forwards=out.num_forwards,
    steps=out.steps,
    commit_iteration=np.where(answered, out.commit_iteration, -1),
    commit_phase=np.where(answered, out.commit_phase, PHASE_NONE),
    seconds=seconds,
    widths={
      name: {w: int(c) for w, c in enumerate(counts) if c} for name, counts in zip(decoder.method.width_names, widths)
    },
  )


def loop_for_mesh(
  decoder: Decoder,
  graphdef: nnx.GraphDef,
  params: Any,
  batch: LoopState,
  mesh: jax.sharding.Mesh,
  rules=LOGICAL_AXIS_RULES,
) -> Loop:
  """Deprecated: `loop_for(decoder, graphdef, mesh, rules)` (the loop no longer needs `params` or `batch`)."""
  del params, batch
  warnings.warn(
    "refusion_jax.decoding.driver.loop_for_mesh is deprecated: use loop_for(decoder, graphdef, mesh, rules); "
    "loop_for_mesh will be removed.",
    DeprecationWarning,
    stacklevel=2,
  )
  return loop_for(decoder, graphdef, mesh, rules)
