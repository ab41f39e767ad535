"""The host side of every decoding method: the one compiled loop, the incremental `Engine` around it, `decode`.

A decoding method is a typed value (`rj.ReFusion`, `rj.AR`, `rj.MDM`) whose
class is a `contract.Method`. `decode_loop` is the one jitted loop that runs
any of them over a `batching.LoopState`, counted by `compile_count`. An
`Engine` holds that loop compiled for (model, method, K rows, prompt bucket,
mesh), with the parameters placed once, and lets the host feed it prompt by
prompt; `decode` runs one to completion over a list of prompts
(docs/method.md §3.3, §3.4).
"""

from __future__ import annotations

import collections
import dataclasses
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from refusion_jax.decoding.batching import LoopState, run_rows
from refusion_jax.decoding.checks import (
  check_positive,
  check_prompts,
  check_special_id,
  check_temperature,
  decoder_special_tokens,
)
from refusion_jax.decoding.compilations import compilations, tagged
from refusion_jax.decoding.contract import DecodeOutputs, Decoder, Method, Settings
from refusion_jax.decoding.mesh import loop_shardings
from refusion_jax.decoding.prompts import bucket_length
from refusion_jax.decoding.result import PHASE_NONE, DecodeResult
from refusion_jax.deprecation import moved_names
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer, inference_view
from refusion_jax.parallel.activations import activation_sharding, normalize_rules
from refusion_jax.parallel.hosts import default_device, place, to_host
from refusion_jax.parallel.sharding import LOGICAL_AXIS_RULES, Rules, batch_parallel_ways, state_shardings


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
# shardings compile anew, so `Loop` hands every input over placed the same way on every call.
decode_loop = jax.jit(_decode_rows, static_argnames=("graphdef", "program", "placement"))

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
    """One loop call on placed inputs."""
    name = self.program[0].name
    with tagged(_LOOP_TAG, f"{_LOOP_TAG}/{name}"):  # the loop's compiles
      return decode_loop(
        self.graphdef, params, state, max_iterations, knobs, program=self.program, placement=self.placement
      )

  def lower(self, params: Any, state: LoopState, max_iterations: Any, knobs: Any) -> jax.stages.Lowered:
    """The loop lowered for abstract inputs (`jax.ShapeDtypeStruct`s carrying their shardings)."""
    return decode_loop.lower(
      self.graphdef, params, state, max_iterations, knobs, program=self.program, placement=self.placement
    )


def compile_count(method: str | None = None) -> int:
  """XLA compilations of the decode loop for one method (`Method.name`: "refusion", "ar", "mdm"), or of all
  its calls, as JAX reports them (`refusion_jax.decoding.compilations`)."""
  return compilations(_LOOP_TAG if method is None else f"{_LOOP_TAG}/{method}")


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


def check_method(method: Any) -> None:
  """Refuse what is not a method value (a method name, a class, a dict of knobs)."""
  if isinstance(method, type) or not callable(getattr(method, "decoder", None)):
    raise ValueError(
      f"method={method!r} is not a decoding method value: pass one such as refusion_jax.ReFusion(gen_length=64), "
      "refusion_jax.AR(gen_length=64) or refusion_jax.MDM(gen_length=64)."
    )


class Engine:
  """One compiled decode loop for (model, method, K rows, prompt bucket P, mesh), fed prompt by prompt.

  The parameters and the method's knobs are placed once, when the engine is built. The host holds a queue of
  Q = `batching.queue_entries(K)` entries; each `advance` fills the free entries with submitted prompts (in
  submission order), runs one loop call and reads back what finished. A server drives it like this:

      engine = Engine(model, rj.ReFusion(gen_length=256), rows=8, prompt_width=128)
      request = engine.submit(prompt_ids)         # -> a request number; queued on the host
      while not engine.idle:
        for done in engine.advance(iterations=4): # one loop call of at most 4 iterations
          result = engine.pop([done])             # its DecodeResult (and forget it)
        engine.partial(request)                   # the answer's committed prefix so far (streaming)
      engine.cancel(request)                      # drop a request, queued or decoding

  Request numbers restart at 0 whenever the engine is idle with no result left to pop; a request's number is what its
  sampling noise folds in (docs/method.md §3.3), so a run of N prompts from idle draws what `decode` draws for them. A
  row's decode never depends on the other rows, so each request gets its B = 1 decode whenever it runs. A request may
  bring its own temperature and seed (`submit`; a server's requests do): they ride in its queue entry, so requests of
  any temperatures and seeds share the rows of one compiled program. The loop hands back to the host when a row turns
  idle while submitted prompts wait on the host, after `iterations` iterations, or when every entry is done; nothing
  compiles again for new prompts of the bucket.

  Attributes:
    loop_calls, host_seconds: the loop calls so far and the host's work around them (refilling the queue,
      placing the state, reading back), the calls themselves not included.
    config: the model's config (of its inference view).
    decoder: the method split for this engine (settings, knobs, the EOS id answers are cut after).
    rows: K, the requested rows rounded up to the mesh's batch-parallel devices.
    prompt_width: P, the prompt bucket: longer prompts are refused.
  """

  def __init__(
    self,
    model: Transformer,
    method: Method,
    *,
    rows: int,
    prompt_width: int,
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules = LOGICAL_AXIS_RULES,
    seed: int = 0,
    mask_id: int | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    sampling: bool = False,
  ):
    """
    Args:
      method: a method value (`rj.ReFusion(...)`, `rj.AR(...)`, `rj.MDM(...)`).
      rows: K rows kept busy (continuous batching).
      prompt_width: P, the prompt bucket (`prompts.bucket_length` of the longest prompt).
      mesh: decode on this mesh (`refusion_jax.make_mesh`): rows split over its batch-parallel axes, parameters
        and cache by their logical axes (`refusion_jax.decoding.mesh`); None: the default device.
      seed: the PRNG seed of sampling: request i draws from fold_in(key(seed), i), unless it brings its own seed.
      mask_id, eos_id, pad_id: the special ids; None: the model config's (`checks.decoder_special_tokens`).
      sampling: compile the sampling noise in even where the method's temperature is 0, so that requests may
        bring their own temperatures (`submit`); a request at temperature 0 stays greedy, bit for bit.
    """
    check_method(method)
    check_positive("rows", rows, "one row per prompt")
    check_positive("prompt_width", prompt_width, "the bucket of the longest prompt")
    model = inference_view(model)  # every decoder runs without remat, on weights cast once (docs/method.md §5)
    self.config = config = model.config
    special = decoder_special_tokens(config, mask_id=mask_id, eos_id=eos_id, pad_id=pad_id)
    sample = method.temperature > 0 or sampling
    self.decoder = method.decoder(config, special, pick_rows=pick_rows_on(mesh, rules), sample=sample)
    self.seed = seed
    self.pad_id = check_special_id("pad_id", special.pad, config)
    self.rows = padded_rows(rows, mesh, rules)
    self.prompt_width = prompt_width
    placed = _placed_program(model, self.decoder, mesh, rules, (method, special, sample))
    self._loop, self._params, self._knobs = placed.loop, placed.params, placed.knobs
    self._chunks = placed.chunks  # placed iteration counts by `advance`'s iterations
    start = _placed_start(self._loop, self.decoder, config, self.rows, prompt_width)
    self._state_shardings, self._state, state = start.shardings, start.placed, start.host
    # The host's copy of the queue, and what the last loop call left in it (read back after every call).
    self._tokens, self._lengths = np.array(state.queue_tokens), np.array(state.queue_lengths)
    self._prompt, self._waiting = np.array(state.queue_prompt), np.array(state.waiting)
    self._key, self._temperature = np.array(state.queue_key), np.array(state.queue_temperature)
    self._busy, self._entry = np.array(state.busy), np.array(state.entry)
    self._out: DecodeOutputs = state.out
    self._widths = np.array(state.widths)
    self._held = np.full(self._waiting.shape, -1)  # the request each entry holds, -1 where free
    # (request, prompt ids, its noise key data, its temperature), in submission order.
    self._pending: collections.deque[tuple[int, list[int], np.ndarray, float]] = collections.deque()
    self._finished: dict[int, dict[str, Any]] = {}
    self._next_request = 0
    self.loop_calls, self.host_seconds = 0, 0.0  # the host's own work over the loop calls (`DecodeResult`)
    # What the host changed since the last call and must send with the next: the queue, the rows' busy flags.
    self._queue_changed, self._busy_changed = True, False

  @property
  def idle(self) -> bool:
    """No request is queued or decoding (finished ones may wait to be popped)."""
    return not self._pending and not np.any(self._held >= 0)

  @property
  def widths(self) -> dict[str, dict[int, int]]:
    """Forwards by query width over the engine's life so far (`DecodeResult.widths`)."""
    return _width_counts(self.decoder.method.width_names, self._widths)

  def submit(self, prompt_ids: Sequence[int], *, temperature: float | None = None, seed: int | None = None) -> int:
    """Queue one prompt of token ids (at most `prompt_width` of them); returns its request number.

    Args:
      temperature: this request's (None: the method's); above 0 needs an engine that samples (`sampling`).
      seed: this request's noise is then that of prompt 0 of a decode with this seed, what `decode(model,
        [prompt_ids], method, seed=seed)` draws (None: the engine's seed, folding in the request number).
    """
    check_prompts([prompt_ids], self.config, self.decoder.settings.gen_length)
    if len(prompt_ids) > self.prompt_width:
      raise ValueError(
        f"A prompt of {len(prompt_ids)} tokens does not fit this engine's prompt bucket of {self.prompt_width}; "
        f"build an engine with prompt_width={bucket_length(len(prompt_ids))}."
      )
    if self.idle and not self._finished:
      self._next_request = 0
    temperature = self.decoder.method.temperature if temperature is None else temperature
    check_temperature(temperature)
    if temperature > 0 and not self.decoder.settings.sample:
      raise ValueError(
        f"temperature={temperature} needs an engine that samples: build it with sampling=True (or a method "
        "whose temperature is above 0)."
      )
    request = self._next_request
    self._next_request += 1
    self._pending.append((request, [int(t) for t in prompt_ids], self._noise_key(request, seed), temperature))
    return request

  def _noise_key(self, request: int, seed: int | None) -> np.ndarray:
    """The raw data of `request`'s noise key; zeros where the program never samples (it reads no key, and a
    greedy request pays for no PRNG dispatch)."""
    if not self.decoder.settings.sample:
      return np.zeros(self._key.shape[1:], self._key.dtype)
    key = jax.random.fold_in(jax.random.key(self.seed if seed is None else seed), request if seed is None else 0)
    return np.asarray(jax.random.key_data(key))

  def advance(self, iterations: int | None = None) -> list[int]:
    """One loop call of at most `iterations` iterations (None: until a row needs a prompt the host holds, or all
    is done); returns the requests that finished in it."""
    if self.idle:
      return []
    start = time.perf_counter()
    self._refill()
    state = self._loop.place_state(self._state, self._state_shardings)
    placed = time.perf_counter()
    self._state = self._loop(self._params, state, self._iterations(iterations), self._knobs)
    jax.block_until_ready(self._state)
    ran = time.perf_counter()
    finished = self._collect()
    self.loop_calls += 1
    self.host_seconds += (placed - start) + (time.perf_counter() - ran)
    return finished

  def partial(self, request: int) -> list[int]:
    """The answer tokens of `request` committed so far, up to the first offset not yet committed (streaming);
    none while it waits on the host for a free queue entry."""
    if request in self._finished:
      return list(self._finished[request]["tokens"])
    entries = self._entries_of(request)
    if not len(entries):
      return []
    committed = np.asarray(self._out.commit_iteration[entries[0]]) >= 0
    count = int(np.argmin(committed)) if not committed.all() else len(committed)
    return _cut(np.asarray(self._out.answer[entries[0], :count]).tolist(), self.decoder.eos_id)

  def forwards(self, request: int) -> int:
    """Forwards the row of `request` took part in so far, its prefill included (0 while it waits on the host)."""
    if request in self._finished:
      return int(self._finished[request]["num_forwards"])
    entries = self._entries_of(request)
    return int(self._out.num_forwards[entries[0]]) if len(entries) else 0

  def _entries_of(self, request: int) -> np.ndarray:
    """The queue entry holding `request` ([] while it waits on the host)."""
    entries = np.flatnonzero(self._held == request)
    if not len(entries) and all(item[0] != request for item in self._pending):
      raise ValueError(
        f"Request {request} is neither decoding nor finished, nor queued (cancelled, popped or never submitted)."
      )
    return entries

  def cancel(self, request: int) -> None:
    """Drop `request`: from the host's queue, or from its entry (and its row, which turns idle)."""
    self._finished.pop(request, None)
    pending = len(self._pending)
    self._pending = collections.deque(item for item in self._pending if item[0] != request)
    self._queue_changed |= len(self._pending) != pending
    for entry in np.flatnonzero(self._held == request):
      self._held[entry] = -1
      self._queue_changed |= bool(self._waiting[entry])
      self._waiting[entry] = False
      rows = self._busy & (self._entry == entry)
      self._busy_changed |= bool(rows.any())
      self._busy[rows] = False

  def pop(self, requests: Sequence[int]) -> DecodeResult:
    """The `DecodeResult` of finished `requests`, in that order (their trace blanked past each answer); the
    engine forgets them. `widths` are the engine's counts so far, `seconds` 0 (the caller times its calls)."""
    missing = [r for r in requests if r not in self._finished]
    if missing:
      raise ValueError(f"Requests {missing} have not finished; advance the engine until advance() returns them.")
    rows = [self._finished.pop(r) for r in requests]
    field = lambda name: np.stack([row[name] for row in rows]) if rows else np.zeros((0,), np.int32)
    return DecodeResult(
      tokens=[list(row["tokens"]) for row in rows],
      num_forwards=field("num_forwards"),
      steps=field("steps"),
      commit_iteration=field("commit_iteration"),
      commit_phase=field("commit_phase"),
      widths=self.widths,
    )

  def run(self, prompt_ids: Sequence[Sequence[int]], chunk_iterations: int | None = None) -> DecodeResult:
    """Decode `prompt_ids` to the end from idle; the result in input order, `seconds` the wall-clock of it all."""
    if not self.idle:
      raise ValueError("The engine is decoding other requests; run() needs an idle engine.")
    start = time.perf_counter()
    before = self._widths.copy(), self.loop_calls, self.host_seconds
    requests = [self.submit(p) for p in prompt_ids]
    while not self.idle:
      self.advance(chunk_iterations)
    result = self.pop(requests)
    result.widths = _width_counts(self.decoder.method.width_names, self._widths - before[0])
    result.loop_calls, result.host_seconds = self.loop_calls - before[1], self.host_seconds - before[2]
    result.seconds = time.perf_counter() - start
    return result

  def _iterations(self, iterations: int | None) -> Any:
    """The placed iteration count of a loop call (placed once per distinct count)."""
    if iterations not in self._chunks:
      check_positive("iterations", iterations, "run the loop until the host must refill it")
      self._chunks[iterations] = self._loop.place_replicated(np.int32(iterations or np.iinfo(np.int32).max))
    return self._chunks[iterations]

  def _refill(self) -> None:
    """Hand the free entries the next submitted prompts; send only what the host changed."""
    free = np.flatnonzero(self._held < 0)[: len(self._pending)]
    if self._busy_changed:
      self._state = self._state.replace(busy=self._busy.copy())
      self._busy_changed = False
    if not len(free) and not self._queue_changed:
      return
    out = jax.tree.map(np.array, self._out)
    for entry in free:
      request, prompt, key, temperature = self._pending.popleft()
      self._held[entry] = request
      self._key[entry], self._temperature[entry] = key, temperature
      self._tokens[entry] = self.pad_id
      self._tokens[entry, : len(prompt)] = prompt
      self._lengths[entry], self._prompt[entry], self._waiting[entry] = len(prompt), request, True
      for field, blank in zip(jax.tree.leaves(out), jax.tree.leaves(DecodeOutputs.empty(1, out.answer.shape[1]))):
        field[entry] = blank[0]
    # Copies: a CPU device may keep using the host buffer it was given, which the next refill writes.
    self._state = self._state.replace(
      queue_tokens=self._tokens.copy(),
      queue_lengths=self._lengths.copy(),
      queue_prompt=self._prompt.copy(),
      queue_key=self._key.copy(),
      queue_temperature=self._temperature.copy(),
      waiting=self._waiting.copy(),
      more=np.bool_(len(self._pending) > 0),
      out=out,
    )
    self._queue_changed = False

  def _collect(self) -> list[int]:
    """Read back the loop's queue; the entries whose request finished are freed and their outputs kept."""
    state = self._state
    self._busy, self._entry, self._waiting, self._out, self._widths = to_host(
      (state.busy, state.entry, state.waiting, state.out, state.widths)
    )
    self._busy, self._waiting = np.array(self._busy), np.array(self._waiting)
    decoding = np.zeros(self._held.shape, bool)
    decoding[self._entry[self._busy]] = True
    done = np.flatnonzero((self._held >= 0) & ~self._waiting & ~decoding)
    finished = []
    for entry in done:
      request = int(self._held[entry])
      self._finished[request] = self._answer(entry)
      self._held[entry] = -1
      finished.append(request)
    return finished

  def _answer(self, entry: int) -> dict[str, Any]:
    """Entry `entry`'s outputs, its answer cut after the first EOS and nothing counted as committed past it."""
    out = self._out
    tokens = _cut(out.answer[entry].tolist(), self.decoder.eos_id)
    # Past the answer nothing counts as committed (a slot after the EOS may have been).
    answered = np.arange(out.answer.shape[1]) < len(tokens)
    return dict(
      tokens=tokens,
      num_forwards=np.array(out.num_forwards[entry]),
      steps=np.array(out.steps[entry]),
      commit_iteration=np.where(answered, out.commit_iteration[entry], -1),
      commit_phase=np.where(answered, out.commit_phase[entry], PHASE_NONE),
    )


@dataclasses.dataclass(frozen=True)
class _PlacedProgram:
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
  programs: dict[tuple, _PlacedProgram]

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
_PROGRAMS_PER_MODEL = 16


def _placed_program(
  model: Transformer, decoder: Decoder, mesh: jax.sharding.Mesh | None, rules: Rules, key: tuple
) -> _PlacedProgram:
  """The loop of `decoder` for `model` on `mesh`, with its parameters and knobs placed (`key`: what fixes the
  knobs and the program besides the placement: the method value, the special ids, whether it samples)."""
  leaves, treedef = jax.tree.flatten(model)
  key = (key, mesh, None if mesh is None else normalize_rules(rules))
  cached = _PROGRAMS.get(model)
  if cached is not None and cached.holds(treedef, leaves) and key in cached.programs:
    return cached.programs[key]
  graphdef, params = nnx.split(model)
  loop = loop_for(decoder, graphdef, mesh, rules)
  placed = _PlacedProgram(loop, loop.place_params(params), loop.place_replicated(decoder.knobs), {})
  param_leaves = jax.tree.leaves(params)
  if all(a is b for a, b in zip(jax.tree.leaves(placed.params), param_leaves)):
    if cached is None or not cached.holds(treedef, leaves):
      cached = _PROGRAMS[model] = _ModelPrograms(treedef, leaves, {})
    if len(cached.programs) >= _PROGRAMS_PER_MODEL:
      cached.programs.pop(next(iter(cached.programs)))
    cached.programs[key] = placed
  return placed


@dataclasses.dataclass(frozen=True)
class _Start:
  """An engine's idle start state: on the host (the engine's copy of the queue is made from it), on its
  devices, and the shardings of the state, whose structure never changes."""

  host: LoopState
  placed: LoopState
  shardings: Any


# Idle start states by everything that fixes them: arrays are immutable and the loop donates none, so every engine
# of a program starts from the same ones (a decode call builds and places only its queue). A few small ones are
# kept: a big model's idle caches would hold device memory between calls.
_STARTS: dict[tuple, _Start] = {}
_STARTS_KEPT, _START_BYTES = 8, 64 * 2**20


def _placed_start(loop: Loop, decoder: Decoder, config: ModelConfig, rows: int, prompt_width: int) -> _Start:
  key = (loop.program, loop.placement, config, rows, prompt_width, jax.config.jax_default_prng_impl)
  if key in _STARTS:
    return _STARTS[key]
  host = start_state(decoder, config, rows, prompt_width)
  shardings = loop.state_shardings(host)
  start = _Start(host, loop.place_state(host, shardings), shardings)
  if sum(leaf.nbytes for leaf in jax.tree.leaves(host)) <= _START_BYTES:  # a big model's caches are not kept idle
    if len(_STARTS) >= _STARTS_KEPT:
      _STARTS.pop(next(iter(_STARTS)))
    _STARTS[key] = start
  return start


def _cut(answer: list[int], eos_id: int) -> list[int]:
  """`answer` up to and including its first `eos_id`."""
  return answer[: answer.index(eos_id) + 1] if eos_id in answer else answer


def _width_counts(names: Sequence[str], counts: np.ndarray) -> dict[str, dict[int, int]]:
  return {name: {w: int(c) for w, c in enumerate(row) if c} for name, row in zip(names, counts)}


def decode(
  model: Transformer,
  prompt_ids: Sequence[Sequence[int]],
  method: Method,
  *,
  batch_size: int | None = None,
  mesh: jax.sharding.Mesh | None = None,
  seed: int = 0,
  mask_id: int | None = None,
  eos_id: int | None = None,
  pad_id: int | None = None,
  chunk_iterations: int | None = None,
) -> DecodeResult:
  """Decode N prompts with a method value, in one compiled loop (docs/method.md §3).

      rj.decode(model, [[1, 2, 3]], rj.ReFusion(gen_length=64, slot_size=4))
      rj.decode(model, prompts, rj.AR(gen_length=32), batch_size=8)

  The loop keeps K rows busy over a queue that the host refills between calls (an `Engine`), so the compiled
  program depends on K, the prompt bucket and the method's settings, never on how many prompts there are.

  Args:
    prompt_ids: N prompts of integer token ids, any lengths (padded into one bucket).
    method: `rj.ReFusion(...)`, `rj.AR(...)` or `rj.MDM(...)`.
    batch_size: K rows kept busy (continuous batching: a finished row takes the next prompt), one compiled
      program whatever N is; None: all N prompts as one batch (K = N).
    mesh: decode on this mesh (`refusion_jax.make_mesh`): rows split over its batch-parallel axes (their count
      padded to a multiple of its batch-parallel devices; padded rows stay idle), parameters and cache by their
      logical axes (`refusion_jax.decoding.mesh`); None: the default device.
    seed: the PRNG seed of sampling (temperature > 0): prompt i draws from fold_in(key(seed), i), whatever the
      batching.
    mask_id, eos_id, pad_id: the special ids; None: the model config's (the `Sampler` passes its tokenizer's).
      ReFusion needs a mask and an EOS id, MDM a mask id; pad_id falls back to the EOS, then 0 (never attended).
    chunk_iterations: run the compiled loop at most this many iterations per call (state in, state out), as a
      server drives it, with the same results; None: each call runs until the queue needs refilling.

  Returns:
    A `DecodeResult` in input order whose trace is blanked past each answer; seconds covers placing, padding,
    the loop (and its compilation, when it happens) and the read-back.
  """
  check_method(method)
  check_prompts(prompt_ids, model.config, method.gen_length)
  check_positive("batch_size", batch_size, "all prompts as one batch")
  check_positive("chunk_iterations", chunk_iterations, "run the loop to the end in one call")
  engine = Engine(
    model,
    method,
    rows=batch_size or len(prompt_ids),
    prompt_width=bucket_length(max(len(p) for p in prompt_ids)),
    mesh=mesh,
    seed=seed,
    mask_id=mask_id,
    eos_id=eos_id,
    pad_id=pad_id,
  )
  return engine.run(prompt_ids, chunk_iterations)


_DECODE_OPTIONS = ("batch_size", "mesh", "seed", "mask_id", "eos_id", "pad_id", "chunk_iterations")


def keyword_decode(method: type[Method]) -> Callable[..., DecodeResult]:
  """The 0.2 call of one method, `<method>_generate(model, prompt_ids, *, <its fields>, <decode's options>)`:
  `decode(model, prompt_ids, method(<its fields>), <decode's options>)`, the same tokens (wrap it in
  `deprecation.deprecated`)."""

  def generate(model: Transformer, prompt_ids: Sequence[Sequence[int]], **options: Any) -> DecodeResult:
    run = {name: options.pop(name) for name in _DECODE_OPTIONS if name in options}
    return decode(model, prompt_ids, method(**options), **run)

  generate.__doc__ = f"The 0.2 call: `decode(model, prompt_ids, {method.__name__}(...), ...)`, the same tokens."
  return generate


__getattr__ = moved_names(
  __name__,
  {
    "Placement": ("refusion_jax.decoding.driver.LoopPlacement", lambda: LoopPlacement),
    "start_batch": ("refusion_jax.decoding.driver.start_state", lambda: start_state),
    "loop_for_mesh": ("refusion_jax.decoding.driver.loop_for(decoder, graphdef, mesh, rules)", lambda: _loop_for_mesh),
  },
)


def _loop_for_mesh(
  decoder: Decoder, graphdef: nnx.GraphDef, params: Any, state: LoopState, mesh: jax.sharding.Mesh, rules=None
) -> Loop:
  """The 0.2 `loop_for_mesh`: `loop_for` (the loop no longer needs `params` or the state)."""
  del params, state
  return loop_for(decoder, graphdef, mesh, LOGICAL_AXIS_RULES if rules is None else rules)
