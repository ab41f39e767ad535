"""The engine and `decode`: K rows of one compiled loop fed prompt by prompt, and a whole list decoded in one call.

An `Engine` holds one `Loop` (`loop.py`) for (model, method, K rows, prompt
bucket, mesh) with its parameters placed once (`programs.py`), and keeps the
host side of continuous batching: the queue the loop reads, which request
holds which entry, each request's sampling noise, what has been committed so
far (streaming), the results and the host's time. `decode` runs one engine
to completion over a list of prompts (docs/method.md §3.3, §3.4).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from refusion_jax.decoding.batching import LoopState
from refusion_jax.decoding.checks import (
  check_method,
  check_positive,
  check_prompts,
  check_sampling_filters,
  check_special_id,
  check_temperature,
  decoder_special_tokens,
)
from refusion_jax.decoding.contract import DecodeOutputs, Decoder, Method
from refusion_jax.decoding.mesh import padded_rows, pick_rows_on
from refusion_jax.decoding.options import DecodeOptions, decode_options
from refusion_jax.decoding.prefix_cache import PrefixCache, PrefixPool, PrefixQueue, pool_shape
from refusion_jax.decoding.programs import placed_program, start_for
from refusion_jax.decoding.prompts import bucket_length
from refusion_jax.decoding.result import PHASE_NONE, DecodeResult, Rollout
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer, inference_view
from refusion_jax.parallel.activations import normalize_rules
from refusion_jax.parallel.hosts import to_host
from refusion_jax.parallel.sharding import LOGICAL_AXIS_RULES, Rules


@dataclasses.dataclass(frozen=True)
class _Submitted:
  """A request waiting on the host for a free queue entry: its prompt, noise key data and sampling rule."""

  request: int
  prompt: list[int]
  key: np.ndarray
  temperature: float
  top_k: int
  top_p: float
  min_p: float


def engine_decoder(
  config: ModelConfig, method: Method, options: DecodeOptions, rules: Rules = LOGICAL_AXIS_RULES, sampling: bool = False
) -> Decoder:
  """The decoder an `Engine` of `method` splits for a model of (inference) `config` under `options` (its special
  ids and mesh) and `rules`: what fixes its compiled loop besides the parameters (`loop.loop_for`) and the rows.
  `python -m refusion_jax.aot` compiles a GRPO step's rollout from it."""
  return _split_method(config, method, options, rules, sampling)[0]


def _split_method(
  config: ModelConfig, method: Method, options: DecodeOptions, rules: Rules, sampling: bool
) -> tuple[Decoder, Any, bool]:
  """(`engine_decoder`'s decoder, the special ids it was split with, whether it samples)."""
  special = decoder_special_tokens(config, **options.special_ids)
  sample = method.temperature > 0 or sampling
  return method.decoder(config, special, pick_rows=pick_rows_on(options.mesh, rules), sample=sample), special, sample


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
  row's decode never depends on the other rows, so each request gets its B = 1 decode whenever it runs (bit for bit
  at the engine's K; docs/method.md §3.3 says what another K may round differently). A request may
  bring its own temperature and seed (`submit`; a server's requests do): they ride in its queue entry, so requests of
  any temperatures and seeds share the rows of one compiled program. The loop hands back to the host when a row turns
  idle while submitted prompts wait on the host, after `iterations` iterations, or when every entry is done; nothing
  compiles again for new prompts of the bucket. With a prefix cache (`DecodeOptions.prefix_cache_tokens`, or one
  shared with other engines), a prompt that begins as an earlier one did takes that beginning's KV from the cache
  and prefills only the rest, with the same decode (docs/serving.md, "The prefix cache").

  Attributes:
    loop_calls, host_seconds: the loop calls so far and the host's work around them (refilling the queue,
      placing the state, reading back), the calls themselves not included.
    config: the model's config (of its inference view).
    decoder: the method split for this engine (settings, knobs, the EOS id answers are cut after).
    rows: K, the requested rows rounded up to the mesh's batch-parallel devices.
    prompt_width: P, the prompt bucket: longer prompts are refused.
    prefix_cache: its `PrefixCache` (None: off), whose counters say what was reused.
    state_bytes: bytes of the loop's state (its rows' KV caches, mostly), the prefix cache's pool apart.
  """

  def __init__(
    self,
    model: Transformer,
    method: Method,
    options: DecodeOptions | None = None,
    *,
    prompt_width: int,
    rules: Rules = LOGICAL_AXIS_RULES,
    sampling: bool = False,
    weights_from: Engine | None = None,
    prefix_cache: PrefixCache | None = None,
    **option_fields: Any,
  ):
    """
    Args:
      method: a method value (`rj.ReFusion(...)`, `rj.AR(...)`, `rj.MDM(...)`).
      options: how the engine decodes (`DecodeOptions`; its `rows`, K, required here), its fields also given
        as keywords (`Engine(model, method, rows=8, prompt_width=64)`). Request i draws its sampling noise from
        fold_in(key(seed), i) unless it brings its own seed; special ids default to the model config's
        (`checks.decoder_special_tokens`); `chunk_iterations` is what `run` advances by.
      prompt_width: P, the prompt bucket (`prompts.bucket_length` of the longest prompt).
      rules: the logical-axis rules placing parameters, cache and rows on `options.mesh`.
      sampling: compile the sampling noise in even where the method's temperature is 0, so that requests may
        bring their own temperatures (`submit`); a request at temperature 0 stays greedy, bit for bit.
      weights_from: an engine of the same model, method, options and rules (another prompt bucket or row count)
        whose placed parameters, knobs and loop this one uses: the weights are placed once for both.
      prefix_cache: a `PrefixCache` of this model that other engines share (None: this engine's own of
        `options.prefix_cache_tokens` tokens, or none where that is 0).
    """
    check_method(method)
    self.options = options = decode_options(options, option_fields, "refusion_jax.Engine")
    if options.rows is None:
      raise ValueError("An engine needs its row count: give rows=K (the rows kept busy), e.g. rows=8.")
    rows, mesh = options.rows, options.mesh
    check_positive("prompt_width", prompt_width, "the bucket of the longest prompt")
    model = inference_view(model)  # every decoder runs without remat, on weights cast once (docs/method.md §5)
    self.config = config = model.config
    self.decoder, special, sample = _split_method(config, method, options, rules, sampling)
    self.pad_id = check_special_id("pad_id", special.pad, config)
    self.rows = padded_rows(rows, mesh, rules)
    self.prompt_width = prompt_width
    self._program_key = ((method, special, sample), mesh, normalize_rules(rules))
    if weights_from is None:
      placed = placed_program(model, self.decoder, mesh, rules, (method, special, sample))
    elif weights_from._program_key != self._program_key or weights_from.config != config:
      raise ValueError(
        "weights_from= must be an engine of the same model, method, special ids, sampling, mesh and rules; build "
        "this one with its own weights instead."
      )
    else:
      placed = weights_from._placed
    self._placed = placed
    self._loop, self._params, self._knobs = placed.loop, placed.params, placed.knobs
    self._chunks = placed.chunks  # placed iteration counts by `advance`'s iterations
    start = start_for(self._loop, self.decoder, config, self.rows, prompt_width)
    # The host start, placed by the first `advance` with the queue: the loop donates the state, so no placed one
    # is shared.
    self._state_shardings, self._state, state = start.shardings, start.host, start.host
    self.prefix_cache = prefix_cache
    if prefix_cache is None and options.prefix_cache_tokens:
      self.prefix_cache = PrefixCache(config, options.prefix_cache_tokens)
    self._prefix: PrefixQueue | None = None  # this engine's entries in the prefix cache (none: a bucket < a block)
    if self.prefix_cache is not None and prompt_width >= self.prefix_cache.block_tokens:
      if self.prefix_cache.config != config:
        raise ValueError("prefix_cache= belongs to a model of another config; give this engine its own.")
      self._prefix = PrefixQueue(self.prefix_cache, state.waiting.shape[0], prompt_width)
      shape = pool_shape(config, self.prefix_cache.blocks, self.prefix_cache.block_tokens)
      blocks = jax.ShapeDtypeStruct(shape, config.compute_dtype)
      abstract = PrefixPool(blocks, blocks, jax.ShapeDtypeStruct(shape[1:2], np.int32))  # made by the first call
      self._state = state.replace(queue_prefix=self._prefix.arrays(), prefix_pool=abstract)
      self._state_shardings = self._loop.state_shardings(self._state)
    self.state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(start.host))
    self._reused: dict[int, int] = {}  # prompt tokens each admitted request took from the prefix cache
    # The host's copy of the queue, and what the last loop call left in it (read back after every call).
    self._tokens, self._lengths = np.array(state.queue_tokens), np.array(state.queue_lengths)
    self._prompt, self._waiting = np.array(state.queue_prompt), np.array(state.waiting)
    self._key, self._temperature = np.array(state.queue_key), np.array(state.queue_temperature)
    self._top_k, self._top_p = np.array(state.queue_top_k), np.array(state.queue_top_p)
    self._min_p = np.array(state.queue_min_p)
    self._busy, self._entry = np.array(state.busy), np.array(state.entry)
    self._out: DecodeOutputs = state.out
    self._widths = np.array(state.widths)
    self._held = np.full(self._waiting.shape, -1)  # the request each entry holds, -1 where free
    self._pending: collections.deque[_Submitted] = collections.deque()  # in submission order
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

  def submit(
    self,
    prompt_ids: Sequence[int],
    *,
    temperature: float | None = None,
    seed: int | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
  ) -> int:
    """Queue one prompt of token ids (at most `prompt_width` of them); returns its request number.

    Args:
      temperature: this request's (None: the method's); above 0 needs an engine that samples (`sampling`).
      seed: this request's noise is then that of prompt 0 of a decode with this seed, what `decode(model,
        [prompt_ids], method, seed=seed)` draws (None: the engine's seed, folding in the request number).
      top_k, top_p, min_p: this request's sampling filters (`scoring.SamplingRule`; 0, 1, 0: off), read only
        where it samples; traced, so any values share the compiled program.
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
    check_sampling_filters(top_k, top_p, min_p)
    if temperature > 0 and not self.decoder.settings.sample:
      raise ValueError(
        f"temperature={temperature} needs an engine that samples: build it with sampling=True (or a method "
        "whose temperature is above 0)."
      )
    request = self._next_request
    self._next_request += 1
    prompt = [int(t) for t in prompt_ids]
    key = self._noise_key(request, seed)
    self._pending.append(_Submitted(request, prompt, key, temperature, int(top_k), float(top_p), float(min_p)))
    return request

  def _noise_key(self, request: int, seed: int | None) -> np.ndarray:
    """The raw data of `request`'s noise key; zeros where the program never samples (it reads no key, and a
    greedy request pays for no PRNG dispatch)."""
    if not self.decoder.settings.sample:
      return np.zeros(self._key.shape[1:], self._key.dtype)
    key = jax.random.fold_in(
      jax.random.key(self.options.seed if seed is None else seed), request if seed is None else 0
    )
    return np.asarray(jax.random.key_data(key))

  def advance(self, iterations: int | None = None) -> list[int]:
    """One loop call of at most `iterations` iterations (None: until a row needs a prompt the host holds, or all
    is done); returns the requests that finished in it."""
    if self.idle:
      return []
    start = time.perf_counter()
    self._refill()
    if self._prefix is not None:  # the pool every engine of the cache shares, as the last call left it
      shardings = self._state_shardings
      shardings = shardings.prefix_pool if isinstance(shardings, LoopState) else shardings  # one: no mesh
      self._state = self._state.replace(prefix_pool=self.prefix_cache.make_pool(shardings))
    state = self._loop.place_state(self._state, self._state_shardings)
    placed = time.perf_counter()
    try:
      self._state = self._loop(self._params, state, self._iterations(iterations), self._knobs)
      jax.block_until_ready(self._state)
    except BaseException:
      if self._prefix is not None:  # the call took the pool (donated): start the cache again
        self.prefix_cache.clear()
      raise
    if self._prefix is not None:
      self.prefix_cache.pool = self._state.prefix_pool
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

  def reused_tokens(self, request: int) -> int:
    """The prompt tokens of `request` whose KV came from the prefix cache (0 without one, or before its
    admission)."""
    return self._reused.get(request, 0)

  def partial_logprobs(self, request: int) -> list[float]:
    """The log-probabilities of `partial(request)`'s tokens (`DecodeResult.logprobs`), in the same order."""
    count = len(self.partial(request))
    if request in self._finished:
      return [float(x) for x in self._finished[request]["logprobs"][:count]]
    entries = self._entries_of(request)
    return [float(x) for x in np.asarray(self._out.logprob[entries[0], :count])] if len(entries) else []

  def forwards(self, request: int) -> int:
    """Forwards the row of `request` took part in so far, its prefill included (0 while it waits on the host)."""
    if request in self._finished:
      return int(self._finished[request]["num_forwards"])
    entries = self._entries_of(request)
    return int(self._out.num_forwards[entries[0]]) if len(entries) else 0

  def _entries_of(self, request: int) -> np.ndarray:
    """The queue entry holding `request` ([] while it waits on the host)."""
    entries = np.flatnonzero(self._held == request)
    if not len(entries) and all(item.request != request for item in self._pending):
      raise ValueError(
        f"Request {request} is neither decoding nor finished, nor queued (cancelled, popped or never submitted)."
      )
    return entries

  def cancel(self, request: int) -> None:
    """Drop `request`: from the host's queue, or from its entry (and its row, which turns idle)."""
    self._finished.pop(request, None)
    self._reused.pop(request, None)
    pending = len(self._pending)
    self._pending = collections.deque(item for item in self._pending if item.request != request)
    self._queue_changed |= len(self._pending) != pending
    for entry in np.flatnonzero(self._held == request):
      self._held[entry] = -1
      self._queue_changed |= bool(self._waiting[entry])
      if self._prefix is not None and self._waiting[entry]:
        self._prefix.drop(entry)
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
    result = DecodeResult(
      tokens=[list(row["tokens"]) for row in rows],
      num_forwards=field("num_forwards"),
      steps=field("steps"),
      commit_iteration=field("commit_iteration"),
      commit_phase=field("commit_phase"),
      widths=self.widths,
    )
    if self.options.logprobs:
      result.logprobs = field("logprobs")
      result.rollout = Rollout(
        *(field(name) for name in ("rollout_tokens", "rollout_iteration", "rollout_phase")),
        logprobs=field("rollout_logprobs"),
      )
    return result

  def run(self, prompt_ids: Sequence[Sequence[int]], chunk_iterations: int | None = None) -> DecodeResult:
    """Decode `prompt_ids` to the end from idle, advancing by `chunk_iterations` iterations a call (None: the
    options'); the result in input order, `seconds` the wall-clock of it all."""
    if not self.idle:
      raise ValueError("The engine is decoding other requests; run() needs an idle engine.")
    start = time.perf_counter()
    before = self._widths.copy(), self.loop_calls, self.host_seconds
    requests = [self.submit(p) for p in prompt_ids]
    while not self.idle:
      self.advance(chunk_iterations or self.options.chunk_iterations)
    result = self.pop(requests)
    result.widths = _width_counts(self.decoder.method.width_names, self._widths - before[0])
    result.loop_calls, result.host_seconds = self.loop_calls - before[1], self.host_seconds - before[2]
    result.seconds = time.perf_counter() - start
    return result

  def compile(self, iterations: int | None = None) -> None:
    """Compile the loop now for `advance(iterations)` calls, without running it (the first call then compiles
    nothing); an `EngineLadder` compiles its buckets' loops on threads at once this way."""
    state, shardings = self._state, self._state_shardings  # the pool abstract or placed: its shape is all we read
    subtrees = jax.tree.structure(shardings).flatten_up_to(state)
    abstract = [
      jax.tree.map(lambda x, s=sharding: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), subtree)
      for subtree, sharding in zip(subtrees, jax.tree.leaves(shardings))
    ]
    abstract = jax.tree.structure(shardings).unflatten(abstract)
    self._loop.compile(self._params, abstract, self._iterations(iterations), self._knobs)

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
      item = self._pending.popleft()
      self._held[entry] = item.request
      self._key[entry], self._temperature[entry] = item.key, item.temperature
      self._top_k[entry], self._top_p[entry], self._min_p[entry] = item.top_k, item.top_p, item.min_p
      self._tokens[entry] = self.pad_id
      self._tokens[entry, : len(item.prompt)] = item.prompt
      self._lengths[entry], self._prompt[entry], self._waiting[entry] = len(item.prompt), item.request, True
      if self._prefix is not None:
        self._prefix.plan(int(entry), item.prompt)
      for field, blank in zip(jax.tree.leaves(out), jax.tree.leaves(DecodeOutputs.empty(1, out.answer.shape[1]))):
        field[entry] = blank[0]
    # Copies: a CPU device may keep using the host buffer it was given, which the next refill writes.
    self._state = self._state.replace(
      queue_tokens=self._tokens.copy(),
      queue_lengths=self._lengths.copy(),
      queue_prompt=self._prompt.copy(),
      queue_key=self._key.copy(),
      queue_temperature=self._temperature.copy(),
      queue_top_k=self._top_k.copy(),
      queue_top_p=self._top_p.copy(),
      queue_min_p=self._min_p.copy(),
      waiting=self._waiting.copy(),
      more=np.bool_(len(self._pending) > 0),
      out=out,
    )
    if self._prefix is not None:
      self._state = self._state.replace(queue_prefix=self._prefix.arrays())
    self._queue_changed = False

  def _collect(self) -> list[int]:
    """Read back the loop's queue; the entries whose request finished are freed and their outputs kept."""
    state = self._state
    reused = None if self._prefix is None else state.queue_prefix.reused
    self._busy, self._entry, self._waiting, self._out, self._widths, reused = to_host(
      (state.busy, state.entry, state.waiting, state.out, state.widths, reused)
    )
    if self._prefix is not None:
      for entry, tokens in self._prefix.admitted(np.array(reused)).items():
        self._reused[int(self._held[entry])] = tokens
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
    committed = out.commit_iteration[entry] >= 0
    return dict(
      tokens=tokens,
      num_forwards=np.array(out.num_forwards[entry]),
      steps=np.array(out.steps[entry]),
      commit_iteration=np.where(answered, out.commit_iteration[entry], -1),
      commit_phase=np.where(answered, out.commit_phase[entry], PHASE_NONE),
      logprobs=np.where(answered, out.logprob[entry], np.nan).astype(np.float32),
      rollout_tokens=np.where(committed, out.answer[entry], -1).astype(np.int32),
      rollout_iteration=np.array(out.commit_iteration[entry]),
      rollout_phase=np.array(out.commit_phase[entry]),
      rollout_logprobs=np.where(committed, out.logprob[entry], np.nan).astype(np.float32),
    )


def _cut(answer: list[int], eos_id: int) -> list[int]:
  """`answer` up to and including its first `eos_id`."""
  return answer[: answer.index(eos_id) + 1] if eos_id in answer else answer


def _width_counts(names: Sequence[str], counts: np.ndarray) -> dict[str, dict[int, int]]:
  return {name: {w: int(c) for w, c in enumerate(row) if c} for name, row in zip(names, counts)}


def decode(
  model: Transformer,
  prompt_ids: Sequence[Sequence[int]],
  method: Method,
  options: DecodeOptions | None = None,
  **option_fields: Any,
) -> DecodeResult:
  """Decode N prompts with a method value, in one compiled loop (docs/method.md §3).

      rj.decode(model, [[1, 2, 3]], rj.ReFusion(gen_length=64, slot_size=4))
      rj.decode(model, prompts, rj.AR(gen_length=32), rows=8)
      rj.decode(model, prompts, method, rj.DecodeOptions(rows=8, seed=1, mesh=mesh))

  The loop keeps K rows busy over a queue that the host refills between calls (an `Engine`), so the compiled
  program depends on K, the prompt bucket and the method's settings, never on how many prompts there are.

  Args:
    prompt_ids: N prompts of integer token ids, any lengths (padded into one bucket).
    method: `rj.ReFusion(...)`, `rj.AR(...)`, `rj.MDM(...)` or any registered method value.
    options: how to decode (`DecodeOptions`: rows, seed, special ids, mesh, chunk_iterations); its fields may
      be given as keywords instead, or over it. rows None: all N prompts as one batch (K = N).

  Returns:
    A `DecodeResult` in input order whose trace is blanked past each answer; seconds covers placing, padding,
    the loop (and its compilation, when it happens) and the read-back.
  """
  options = decode_options(options, option_fields, "refusion_jax.decode")
  check_method(method)
  check_prompts(prompt_ids, model.config, method.gen_length)
  rows = options.rows or len(prompt_ids)
  engine = Engine(
    model, method, dataclasses.replace(options, rows=rows), prompt_width=bucket_length(max(len(p) for p in prompt_ids))
  )
  return engine.run(prompt_ids)
