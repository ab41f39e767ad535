"""The server's decode worker: a thread driving the engines; requests join at the next loop-call boundary.

The worker's thread owns a `refusion_jax.decoding.ladder.EngineLadder` (one
compiled loop of K rows over a queue per prompt bucket, docs/method.md §3.4;
a request runs in the smallest bucket that holds its prompt) and drives it in
calls of a few iterations (`chunk_iterations`), one bucket's loop per call. Between two calls it hands the engine the
requests that arrived, cancels those whose client left or whose answer is
complete, and reads every running answer's committed prefix into its
`TextStream`, delivering the new text. So a request starts decoding as soon as
a row is free, never after the rows drain, and its row is freed at the first
boundary after its answer ends: at its EOS, a stop string, or its token limit
(`max_tokens`, rounded up to the slot grid: answers are committed slot by slot).

Bounded: at most K + `max_queue` requests are held; one more is refused with
429 and a Retry-After. One request's failure (its text, its delivery) ends
that request only; a failure of the loop itself ends the requests it was
decoding with a 500 and the thread goes on with a fresh queue. What cannot be
recovered from here, the thread's death or a loop call that never returns,
`liveness` reports (the server's /health and watchdog read it).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable

from refusion_jax.data.tokenizer import Tokenizer
from refusion_jax.decoding.ladder import EngineLadder
from refusion_jax.decoding.text_stream import TextStream
from refusion_jax.serving.errors import APIError
from refusion_jax.serving.metrics import Metrics

logger = logging.getLogger("refusion_jax.serving")


@dataclasses.dataclass
class Update:
  """What a request receives after a loop call: new text, and at the end its finish and statistics.

  tokens: the answer ids read since the last update (the text may hold back the end of theirs).
  logprobs: their log-probabilities, aligned with `tokens`, for a job that asked (`Job.logprobs`), else None.
  answer_tokens: the answer ids read so far, these included.
  cached_tokens: at the end, the prompt tokens whose KV the prefix cache supplied (`Engine.reused_tokens`).
  queue_seconds: from arrival to the start of the row's decode (the wait for a free row included).
  error: set instead when the request failed (then nothing else follows).
  """

  text: str = ""
  finish_reason: str | None = None
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] | None = None
  answer_tokens: int = 0
  cached_tokens: int = 0
  forwards: int = 0
  queue_seconds: float = 0.0
  decode_seconds: float = 0.0
  error: APIError | None = None


@dataclasses.dataclass(eq=False)
class Job:
  """One request inside the engine.

  Attributes:
    prompt_ids: the prompt's token ids (within the engine's prompt bucket).
    max_tokens: the token limit (`DecodeWorker.token_limit` of the request's).
    temperature, seed: the request's sampling (None: the server's; set by `DecodeWorker.submit`).
    stops: stop strings.
    deliver: called on the engine thread with each `Update`; must not block.
    top_k, top_p, min_p: the request's sampling filters (`Engine.submit`; the defaults filter nothing).
    stop_ids: token ids that end the answer (`TextStream.stop_ids`).
    logprobs: deliver each answer token's log-probability (`Update.logprobs`).
    arrived, admitted, started: when the request arrived, was handed to the engine, and its row began decoding
      it (the start of the loop call that prefilled it: the wait for a free row counts as queue time).
  """

  prompt_ids: list[int]
  max_tokens: int
  temperature: float | None
  seed: int | None
  stops: tuple[str, ...]
  deliver: Callable[[Update], None]
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  stop_ids: tuple[int, ...] = ()
  logprobs: bool = False
  arrived: float = dataclasses.field(default_factory=time.perf_counter)
  admitted: float | None = None
  started: float | None = None
  request: int | None = None  # the engine's request number, once handed to it
  stream: TextStream | None = None
  sent: int = 0  # answer ids delivered so far
  cancelled: bool = False


class DecodeWorker:
  """Requests in, text increments out, over one decode engine driven by a background thread."""

  def __init__(
    self,
    engine: EngineLadder,
    tokenizer: Tokenizer,
    *,
    max_queue: int,
    chunk_iterations: int,
    metrics: Metrics | None = None,
    seed: int | None = None,
  ):
    """
    Args:
      engine: the compiled decode loops (their rows, their prompt buckets), warmed up by the caller.
      tokenizer: decodes answers.
      max_queue: requests held beyond the K decoding ones before 429s.
      chunk_iterations: loop iterations per call: new requests wait at most this long for a boundary.
      seed: the sampling seed of requests that give none; None: a new random one for each.
    """
    self.engine, self.tokenizer, self.metrics = engine, tokenizer, metrics
    self.max_queue, self.chunk_iterations, self.seed = max_queue, chunk_iterations, seed
    method = engine.decoder.method
    self.temperature = method.temperature
    self.gen_length = method.gen_length
    self.token_grid = method.token_grid  # what a token limit is rounded up to (a ReFusion slot)
    self._lock = threading.Condition()
    self._inbox: collections.deque[Job] = collections.deque()
    self._running: list[Job] = []
    self._draining = self._stopping = False
    self._thread = threading.Thread(target=self._run, name="refusion-decode-worker", daemon=True)
    self._request_seconds = collections.deque(maxlen=64)
    self._calling_since: float | None = None  # when the loop call in flight began (None: none is)
    self.death: BaseException | None = None  # what ended the engine thread, if anything did

  @property
  def max_prompt_tokens(self) -> int:
    return self.engine.prompt_width

  def token_limit(self, max_tokens: int | None) -> int:
    """The token limit of a request asking for `max_tokens` (None: as many as the answer length G has):
    rounded up to the slot grid, at most G."""
    if max_tokens is None:
      return self.gen_length
    return min(self.gen_length, -(-max_tokens // self.token_grid) * self.token_grid)

  @property
  def held(self) -> int:
    """Requests not finished: queued or decoding."""
    with self._lock:
      return len(self._inbox) + len(self._running)

  @property
  def queue_depth(self) -> int:
    """Requests waiting for a row (held beyond the K rows)."""
    return max(0, self.held - self.engine.rows)

  @property
  def rows_busy(self) -> int:
    """Requests whose row is decoding them (vLLM's running requests)."""
    with self._lock:
      return sum(job.started is not None for job in self._running)

  @property
  def waiting(self) -> int:
    """Requests held that no row decodes yet (vLLM's waiting requests)."""
    return self.held - self.rows_busy

  def liveness(self, timeout: float) -> str | None:
    """None while the engine thread serves; else why it cannot: the thread died, or the loop call in flight has
    run longer than `timeout` seconds (a hung device call)."""
    if self._thread.ident is not None and not self._thread.is_alive() and not self._stopping:
      return f"the decode engine's thread died ({self.death!r})"
    since = self._calling_since
    if since is not None and time.perf_counter() - since > timeout:
      return f"a decode loop call has not returned in {time.perf_counter() - since:.0f} s (the limit is {timeout:g} s)"
    return None

  @property
  def draining(self) -> bool:
    """New requests are refused (the server is shutting down)."""
    return self._draining

  def start(self) -> None:
    self._thread.start()

  def submit(self, *jobs: Job) -> None:
    """Queue `jobs` (one request's choices: all or none) for the next loop-call boundary.

    Raises:
      APIError: 503 when the server is shutting down or its engine thread died, 429 (with Retry-After) when
        K + max_queue would be exceeded.
    """
    with self._lock:
      if self._draining:
        raise APIError(503, "The server is shutting down; retry on another instance.", type="server_error")
      if self._thread.ident is not None and not self._thread.is_alive():
        raise APIError(503, "The server's decode engine has stopped; retry on another instance.", type="server_error")
      if len(self._inbox) + len(self._running) + len(jobs) > self.engine.rows + self.max_queue:
        raise APIError(
          429,
          f"The server holds {self.engine.rows + self.max_queue} requests (its rows and queue are full); "
          "retry after the number of seconds in the Retry-After header.",
          type="rate_limit_error",
          code="queue_full",
          headers={"Retry-After": str(self._retry_after())},
        )
      for job in jobs:
        if job.temperature is None:
          job.temperature = self.temperature
        if job.seed is None:
          job.seed = secrets.randbits(31) if self.seed is None else self.seed
        eos = self.engine.decoder.eos_id
        job.stream = TextStream(self.tokenizer, eos, job.max_tokens, job.stops, tuple(job.stop_ids))
        self._inbox.append(job)
      self._lock.notify()

  def cancel(self, job: Job) -> None:
    """Stop `job` (its client left): its row is freed at the next boundary."""
    with self._lock:
      job.cancelled = True
      self._lock.notify()

  def drain(self) -> None:
    """Refuse new requests (503); the held ones go on."""
    with self._lock:
      self._draining = True

  def abandon(self, reason: str) -> None:
    """End every held request with a 503 saying `reason` (the engine cannot serve them: `liveness`)."""
    with self._lock:
      held, self._inbox = [*self._running, *self._inbox], collections.deque()
      self._running = []
    for job in held:
      job.deliver(Update(error=APIError(503, f"The server cannot answer: {reason}.", type="server_error")))

  def stop(self, timeout: float) -> None:
    """Refuse new requests, end the held ones (cancelled) and the thread, waiting at most `timeout` seconds."""
    with self._lock:
      self._draining = self._stopping = True
      self._lock.notify()
    if self._thread.is_alive():
      self._thread.join(timeout)

  def _retry_after(self) -> int:
    """Seconds until a row is likely free: the recent mean request time per row, at least 1."""
    if not self._request_seconds:
      return 1
    mean = sum(self._request_seconds) / len(self._request_seconds)
    return max(1, math.ceil(mean * (1 + self.max_queue / self.engine.rows) / 2))

  # --- the engine thread ---------------------------------------------------------------------------------

  def _run(self) -> None:
    try:
      self._serve()
    except BaseException as error:  # noqa: BLE001  (recorded for `liveness`, then the thread ends as it would)
      self.death = error
      logger.critical("the decode engine's thread died", exc_info=error)
      raise

  def _serve(self) -> None:
    while True:
      with self._lock:
        while not self._stopping and not self._inbox and not self._running:
          self._lock.wait()
        if self._stopping:
          break
        arrived, self._inbox = list(self._inbox), collections.deque()
        self._running += arrived
      try:
        self._boundary(arrived)
      except Exception as error:  # never let the thread die: end what it held, go on with a fresh queue
        self._fail(list(self._running), error)
    for job in self._running + list(self._inbox):
      self._end(job, Update(error=APIError(503, "The server shut down before the answer ended.", type="server_error")))

  def _boundary(self, arrived: list[Job]) -> None:
    """Between two loop calls: admit `arrived`, drop cancelled requests, run one call, deliver text."""
    for job in arrived:
      if job.cancelled:  # its client left before it reached the engine
        continue
      try:
        job.request = self.engine.submit(
          job.prompt_ids,
          temperature=job.temperature,
          seed=job.seed,
          top_k=job.top_k,
          top_p=job.top_p,
          min_p=job.min_p,
        )
      except ValueError as error:  # what the decoder refuses that the app's checks let through
        self._end(job, Update(error=APIError(400, str(error))))
        continue
      job.admitted = time.perf_counter()
    for job in [job for job in self._running if job.cancelled]:
      self._end(job, None)
    if not self._running:
      return
    start = self._calling_since = time.perf_counter()
    try:
      finished = set(self.engine.advance(self.chunk_iterations))
    except Exception as error:  # the loop failed: end what it was decoding, keep serving
      self._fail(list(self._running), error)
      return
    finally:
      self._calling_since = None
    if self.metrics:
      self.metrics.add("loop_calls_total", 1)
      self.metrics.add("loop_seconds_total", time.perf_counter() - start)
    for job in list(self._running):
      try:
        if job.started is None and self.engine.forwards(job.request) > 0:  # this call gave it a row
          job.started = start
        self._read(job, job.request in finished)
      except Exception as error:  # this request's text or delivery failed: end it alone
        self._fail([job], error)

  def _read(self, job: Job, final: bool) -> None:
    """Hand `job` the text its committed prefix settled (and the ids read); end it when its answer is over."""
    text = job.stream.update(self.engine.partial(job.request), final=final)
    read = len(job.stream.tokens)
    tokens = job.stream.tokens[job.sent :]
    logprobs = self.engine.partial_logprobs(job.request)[job.sent : read] if job.logprobs and tokens else None
    job.sent = read
    if job.stream.finish_reason is None:
      if text or tokens:
        job.deliver(Update(text=text, tokens=tokens, logprobs=logprobs, answer_tokens=read))
      return
    now = time.perf_counter()
    started = job.started if job.started is not None else job.admitted
    update = Update(
      text=text,
      finish_reason=job.stream.finish_reason,
      tokens=tokens,
      logprobs=logprobs,
      answer_tokens=read,
      cached_tokens=self.engine.reused_tokens(job.request),
      forwards=self.engine.forwards(job.request),
      queue_seconds=started - job.arrived,
      decode_seconds=now - started,
    )
    self._request_seconds.append(now - job.arrived)
    self._end(job, update)

  def _fail(self, jobs: list[Job], error: Exception) -> None:
    """End `jobs` with a 500 naming `error` (logged with its traceback)."""
    logger.error("ending %d request(s) after a failure", len(jobs), exc_info=error)
    for job in jobs:
      self._end(job, Update(error=APIError(500, f"The server failed on this request: {error}", type="server_error")))

  def _end(self, job: Job, update: Update | None) -> None:
    """Free `job`'s row and entry and send it its last update (None: its client left, send nothing)."""
    if job.request is not None:
      self.engine.cancel(job.request)
    with self._lock:
      if job in self._running:
        self._running.remove(job)
    if update is not None:
      try:
        job.deliver(update)
      except Exception:  # the client's side is gone; nothing else depends on it
        logger.exception("could not deliver the last update of a request")
