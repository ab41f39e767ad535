"""The FastAPI app: OpenAI's `/v1/completions`, `/v1/chat/completions` and `/v1/models`, vLLM's `/tokenize`,
`/detokenize` and `/tokenizer_info`, plus `/health` and `/metrics`.

Every request is bounded before any work: the key (`serving.auth`, all paths
but /health), the body size (413), the body's fields (`serving.schemas`, 400),
the prompts' lengths (400, each must fit the prompt bucket the server
compiled). Tokenizing and the chat template run off the event loop. A request
becomes one `serving.worker.Job` per choice (each prompt, `n` times); the
worker's thread delivers their text increments through an asyncio queue, as
one response or as server-sent events (`serving.sse`). A client that
disconnects cancels its jobs at once, which frees their rows at the next
loop-call boundary. Errors are OpenAI's error object (`serving.errors`); each
request is logged once with its id and timings (`serving.request_log`) and
counted in /metrics by its route's template.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import fastapi
import pydantic
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from refusion_jax.data.chat import render_messages
from refusion_jax.data.tokenizer import HFTokenizer, Tokenizer
from refusion_jax.decoding.stop_strings import check_stop_strings
from refusion_jax.serving import schemas, sse
from refusion_jax.serving.auth import check_authorization
from refusion_jax.serving.errors import APIError, bad_request
from refusion_jax.serving.logprobs import AnswerLogprobs, TokenLogprob, token_bytes
from refusion_jax.serving.metrics import CONTENT_TYPE, UNMATCHED, Metrics
from refusion_jax.serving.request_log import log_request
from refusion_jax.serving.worker import DecodeWorker, Job, Update

# Request bodies above this many bytes are refused with 413 unless the server says otherwise.
DEFAULT_MAX_BODY_BYTES = 1 << 20
# Stop strings a request may give unless the server says otherwise (--max_stop): lm-eval sends a task's whole
# `until` list plus the EOS.
DEFAULT_MAX_STOP = 16
# Seconds a loop call may run before /health reports the engine hung (--watchdog_seconds; SGLang's default).
DEFAULT_WATCHDOG_SECONDS = 300.0
_SEEDS = 2**63  # seeds are taken modulo this (a request's n answers draw with seed, seed + 1, ...)


def route_of(app: Any, scope: dict) -> str:
  """The template of the route `scope`'s path matches (`/v1/models/{model}`), else UNMATCHED: a bounded label."""
  partial = None
  for route in app.router.routes:
    match, _ = route.matches(scope)
    if match == Match.FULL:
      return route.path
    if match == Match.PARTIAL and partial is None:  # the path is a route's, the method is not
      partial = route.path
  return partial or UNMATCHED


class _Guard:
  """ASGI middleware: the API key and the declared body size, checked before the app reads anything."""

  def __init__(self, app: Any, api_key: str | None, max_body_bytes: int, metrics: Metrics):
    self.app, self.api_key, self.max_body_bytes, self.metrics = app, api_key, max_body_bytes, metrics

  async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
    if scope["type"] != "http" or scope["path"] == "/health":
      return await self.app(scope, receive, send)
    headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
    try:
      check_authorization(headers.get("authorization"), self.api_key)
      declared = headers.get("content-length")
      if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
        raise _too_large(self.max_body_bytes)
    except APIError as error:
      route = route_of(self.app, scope)
      self.metrics.count_request(route, error.status)
      log_request("-", route, error.status, error=error.code or error.type)
      return await _error_response(error)(scope, receive, send)
    return await self.app(scope, receive, send)


def _too_large(limit: int) -> APIError:
  return APIError(413, f"The request body is larger than {limit} bytes; send a shorter prompt.", code="body_too_large")


def _error_response(error: APIError) -> JSONResponse:
  return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _read_body(request: fastapi.Request, limit: int) -> bytes:
  """The body, refused with 413 as soon as it passes `limit` bytes (a body sent without Content-Length too)."""
  body = bytearray()
  async for chunk in request.stream():
    body += chunk
    if len(body) > limit:
      raise _too_large(limit)
  return bytes(body)


def _parse(model: type[pydantic.BaseModel], body: bytes) -> Any:
  """`body` as `model`, or 400 naming the first field at fault."""
  try:
    return model.model_validate_json(body)
  except pydantic.ValidationError as error:
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or None
    if first["type"] == "json_invalid":
      raise bad_request(f"The body is not valid JSON: {first['msg']}.") from None
    if first["type"] == "extra_forbidden":
      raise bad_request(f"Unknown field {field!r}: this server does not take it; leave it out.", param=field) from None
    raise bad_request(f"{field}: {first['msg']}.", param=field) from None


async def _disconnected(request: fastapi.Request) -> None:
  """Returns when the client has gone (its body is read, so the next ASGI message is the disconnect)."""
  while (await request.receive())["type"] != "http.disconnect":
    pass


def _spelling(tokenizer: Tokenizer, token: int | None) -> str | None:
  """A special token's text (the byte tokenizer's have none)."""
  return tokenizer.token_text(token) if isinstance(tokenizer, HFTokenizer) and token is not None else None


class ServerState:
  """What the endpoints share: the decode worker, the tokenizer, the served name and the limits."""

  def __init__(self, worker: DecodeWorker, tokenizer: Tokenizer, model_name: str, metrics: Metrics, max_stop: int):
    self.worker, self.tokenizer, self.model_name, self.metrics = worker, tokenizer, model_name, metrics
    self.max_stop = max_stop
    self.created = int(time.time())

  def prompt_ids(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
    """The prompt's token ids, checked against the vocabulary and the prompt bucket."""
    try:
      ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    except ValueError as error:  # a checkpoint without a tokenizer takes token ids only
      raise bad_request(str(error), param=param) from None
    if not ids:
      raise bad_request("The prompt is empty after tokenisation; give at least one character.", param=param)
    vocab = self.worker.engine.config.vocab_size
    if any(not 0 <= token < vocab for token in ids):
      raise bad_request(f"Prompt token ids must lie in [0, {vocab}).", param=param)
    if len(ids) > self.worker.max_prompt_tokens:
      raise bad_request(
        f"The prompt has {len(ids)} tokens; this server takes at most {self.worker.max_prompt_tokens} "
        "(its prompt bucket, --max_prompt_tokens): shorten the prompt.",
        param=param,
        code="context_length_exceeded",
      )
    return ids

  def request_ids(self, body: schemas.GenerationRequest, chat: bool) -> list[list[int]]:
    """The token ids of each prompt of a checked request (a chat rendered by the checkpoint's template)."""
    if chat:
      messages = [dict(role=m.role, content=m.text()) for m in body.messages]
      return [self.prompt_ids(render_messages(self.tokenizer, messages), param="messages")]
    return [self.prompt_ids(prompt) for prompt in body.prompts()]

  def check_model(self, model: str) -> None:
    if model != self.model_name:
      raise APIError(
        404,
        f"The model {model!r} does not exist here; this server serves {self.model_name!r} (GET /v1/models).",
        param="model",
        code="model_not_found",
      )

  def jobs(
    self, body: schemas.GenerationRequest, prompts: list[list[int]], deliver: Callable[[int, Update], None]
  ) -> list[Job]:
    """The worker's jobs of a checked request, choice p·n + i answering prompt p with seed + i."""
    try:
      stops = check_stop_strings(body.stop, self.max_stop)
    except ValueError as error:
      raise bad_request(f"{error} (this server's --max_stop)", param="stop") from None
    stop_ids = tuple(body.stop_token_ids or ())
    vocab = self.worker.engine.config.vocab_size
    if len(stop_ids) > self.max_stop or any(not 0 <= token < vocab for token in stop_ids):
      raise bad_request(
        f"stop_token_ids: give at most {self.max_stop} ids, each in [0, {vocab}).", param="stop_token_ids"
      )
    held = self.worker.engine.rows + self.worker.max_queue
    if len(prompts) * body.n > held:
      raise bad_request(
        f"{len(prompts)} prompt(s) × n={body.n} asks for {len(prompts) * body.n} answers; this server holds at "
        f"most {held} at once: send fewer prompts or a smaller n.",
        param="n",
      )
    limit = self.worker.token_limit(body.max_tokens)
    sampling = dict(body.filters(), logprobs=body.wants_logprobs())
    base = body.seed if body.seed is not None else self.worker.seed
    jobs = []
    for prompt in prompts:
      for i in range(body.n):
        seed = None if base is None else (base + i) % _SEEDS
        index = len(jobs)
        send = lambda update, index=index: deliver(index, update)  # noqa: E731
        jobs.append(Job(prompt, limit, body.temperature, seed, stops, send, stop_ids=stop_ids, **sampling))
    return jobs

  def stats(self, job: Job, last: Update) -> schemas.DecodeStats:
    return schemas.DecodeStats(
      forwards=last.forwards,
      tokens_per_forward=last.answer_tokens / max(last.forwards, 1),
      decode_seconds=last.decode_seconds,
      queue_seconds=last.queue_seconds,
      max_tokens=job.max_tokens,
      gen_length=self.worker.gen_length,
      temperature=job.temperature,
      seed=job.seed,
      top_k=job.top_k,
      top_p=job.top_p,
      min_p=job.min_p,
    )


@dataclasses.dataclass
class _Choice:
  """One answer of a request as the app follows it: its job, text, log-probabilities and times."""

  index: int
  job: Job
  logprobs: AnswerLogprobs | None
  text: str = ""
  last: Update | None = None  # the finishing update
  read_at: float | None = None  # when answer tokens were last read (None: none yet)


def _usage(choices: list[_Choice]) -> schemas.Usage:
  """Prompt tokens counted once per prompt (its n answers share it), answer tokens of every choice; a prompt's
  cached tokens are those the prefix cache supplied to every one of its answers (a cold prompt's first answer
  computes them, so it has none)."""
  prompts, cached = {}, {}
  for c in choices:
    key = id(c.job.prompt_ids)
    prompts[key] = len(c.job.prompt_ids)
    reused = c.last.cached_tokens if c.last else 0
    cached[key] = min(cached.get(key, reused), reused)
  prompt, answer = sum(prompts.values()), sum(c.last.answer_tokens for c in choices if c.last)
  details = schemas.PromptTokensDetails(cached_tokens=sum(cached.values()))
  return schemas.Usage(
    prompt_tokens=prompt, completion_tokens=answer, total_tokens=prompt + answer, prompt_tokens_details=details
  )


def create_app(
  worker: DecodeWorker,
  tokenizer: Tokenizer,
  model_name: str,
  *,
  api_key: str | None = None,
  max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
  max_stop: int = DEFAULT_MAX_STOP,
  watchdog_seconds: float = DEFAULT_WATCHDOG_SECONDS,
  gauges: dict[str, tuple[str, Callable[[], float]]] | None = None,
  lifespan: Callable[[Any], Any] | None = None,
) -> Any:
  """The server's app over a started decode `worker` (the caller starts and stops it; see `refusion_jax.serve`).

  Args:
    model_name: the one model id the server answers to.
    api_key: require `Authorization: Bearer <api_key>` on every path but /health (None: open).
    max_body_bytes: larger request bodies get 413.
    max_stop: the most stop strings (and stop token ids) a request may give.
    watchdog_seconds: /health answers 503 when a loop call has run longer than this (or the engine thread died).
    gauges: more /metrics gauges (name -> (help, read)), besides the requests running and waiting.
    lifespan: the app's lifespan (FastAPI's), e.g. stopping the worker when the server stops.

  Returns:
    The ASGI app (FastAPI's, behind the key and body-size guard).
  """
  metrics = Metrics(
    {
      "num_requests_running": ("Requests whose row is decoding them.", lambda: worker.rows_busy),
      "num_requests_waiting": ("Requests held that no row decodes yet.", lambda: worker.waiting),
      "queue_depth": ("Requests held beyond the K rows.", lambda: worker.queue_depth),
      "rows_busy": ("Rows decoding a request (num_requests_running).", lambda: worker.rows_busy),
      "rows": ("Rows of the decode loop (K).", lambda: worker.engine.rows),
      **(gauges or {}),
    }
  )
  worker.metrics = metrics
  state = ServerState(worker, tokenizer, model_name, metrics, max_stop)
  app = fastapi.FastAPI(title="refusion_jax", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

  @app.exception_handler(APIError)
  async def api_error(request: fastapi.Request, error: APIError) -> JSONResponse:
    route = route_of(app, request.scope)
    metrics.count_request(route, error.status)
    log_request(getattr(request.state, "request_id", "-"), route, error.status, error=error.code or error.type)
    return _error_response(error)

  @app.exception_handler(HTTPException)
  async def not_routed(request: fastapi.Request, error: HTTPException) -> JSONResponse:  # 404, 405
    message = f"{request.method} {request.url.path}: {error.detail}; the server's API is in docs/serving.md."
    code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
    return await api_error(request, APIError(error.status_code, message, code=code))

  @app.exception_handler(Exception)
  async def failure(request: fastapi.Request, error: Exception) -> JSONResponse:
    return await api_error(request, APIError(500, f"The server failed: {error}", type="server_error"))

  @app.get("/health")
  async def health() -> JSONResponse:
    reason = worker.liveness(watchdog_seconds)
    if reason is not None:
      return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)
    if worker.draining:
      return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})

  @app.get("/metrics")
  async def prometheus() -> PlainTextResponse:
    return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)

  def card() -> schemas.ModelCard:
    return schemas.ModelCard(
      id=model_name,
      created=state.created,
      max_prompt_tokens=worker.max_prompt_tokens,
      gen_length=worker.gen_length,
      token_grid=worker.token_grid,
    )

  @app.get("/v1/models")
  async def models() -> JSONResponse:
    return JSONResponse(schemas.ModelList(data=[card()]).model_dump())

  @app.get("/v1/models/{model:path}")
  async def model(model: str) -> JSONResponse:
    state.check_model(model)
    return JSONResponse(card().model_dump())

  @app.get("/tokenizer_info")
  async def tokenizer_info() -> JSONResponse:
    """vLLM's: the tokenizer's special tokens and chat template (lm-eval's remote tokenizer reads them)."""
    return JSONResponse(
      dict(
        tokenizer_class=type(tokenizer).__name__,
        eos_token=_spelling(tokenizer, tokenizer.eos_id),
        bos_token=_spelling(tokenizer, tokenizer.bos_id),
        pad_token=_spelling(tokenizer, tokenizer.pad_id),
        chat_template=getattr(tokenizer, "chat_template", None),
        model_max_length=worker.max_prompt_tokens + worker.gen_length,
      )
    )

  @app.post("/tokenize")
  async def tokenize(request: fastapi.Request) -> JSONResponse:
    """vLLM's: the ids the server decodes a prompt from (it adds no special token, whatever add_special_tokens
    says)."""
    body = _parse(schemas.TokenizeRequest, await _read_body(request, max_body_bytes))
    if body.model is not None:
      state.check_model(body.model)
    ids = await asyncio.to_thread(tokenizer.encode, body.prompt)
    return JSONResponse(dict(count=len(ids), max_model_len=worker.max_prompt_tokens + worker.gen_length, tokens=ids))

  @app.post("/detokenize")
  async def detokenize(request: fastapi.Request) -> JSONResponse:
    body = _parse(schemas.DetokenizeRequest, await _read_body(request, max_body_bytes))
    if body.model is not None:
      state.check_model(body.model)
    if any(not 0 <= token < worker.engine.config.vocab_size for token in body.tokens):
      raise bad_request(f"tokens must lie in [0, {worker.engine.config.vocab_size}).", param="tokens")
    return JSONResponse(dict(prompt=await asyncio.to_thread(tokenizer.decode, body.tokens)))

  async def serve(request: fastapi.Request, chat: bool) -> Any:
    """A completion (`chat` False) or chat completion request, from its body to its response."""
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    request.state.request_id = request_id
    raw = await _read_body(request, max_body_bytes)
    body = _parse(schemas.ChatCompletionRequest if chat else schemas.CompletionRequest, raw)
    state.check_model(body.model)
    body.unsupported()
    prompts = await asyncio.to_thread(state.request_ids, body, chat)  # tokenizing and templating: off the loop
    updates: asyncio.Queue[tuple[int, Update]] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    jobs = state.jobs(
      body, prompts, lambda index, update: loop.call_soon_threadsafe(updates.put_nowait, (index, update))
    )
    worker.submit(*jobs)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    reply = _Reply(state, request_id, route_of(app, request.scope), jobs, chat, updates, include_usage)
    if body.stream:
      return StreamingResponse(reply.events(), media_type=sse.MEDIA_TYPE, headers={"X-Request-Id": request_id})
    return await reply.whole(request)

  @app.post("/v1/completions")
  async def completions(request: fastapi.Request) -> Any:
    return await serve(request, chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: fastapi.Request) -> Any:
    return await serve(request, chat=True)

  return _Guard(app, api_key, max_body_bytes, metrics)


class _Reply:
  """One request's answers, as one JSON body or as server-sent events."""

  def __init__(
    self,
    state: ServerState,
    request_id: str,
    route: str,
    jobs: list[Job],
    chat: bool,
    updates: asyncio.Queue[tuple[int, Update]],
    include_usage: bool,
  ):
    self.state, self.request_id, self.route, self.chat = state, request_id, route, chat
    self.updates, self.include_usage = updates, include_usage
    self.choices = [
      _Choice(i, job, AnswerLogprobs(state.tokenizer) if job.logprobs else None) for i, job in enumerate(jobs)
    ]
    self.created = int(time.time())
    self.first_text: float | None = None

  @property
  def done(self) -> bool:
    return all(choice.last is not None for choice in self.choices)

  async def _next(self) -> tuple[_Choice, Update]:
    """The next update of one of the choices, its times recorded (vLLM's histograms)."""
    index, update = await self.updates.get()
    if update.error is not None:
      raise update.error
    choice, now, metrics = self.choices[index], time.perf_counter(), self.state.metrics
    if update.text and self.first_text is None:
      self.first_text = now
    if update.tokens:
      if choice.read_at is None:
        metrics.observe("time_to_first_token_seconds", now - choice.job.arrived)
      else:
        metrics.observe("inter_token_latency_seconds", (now - choice.read_at) / len(update.tokens), len(update.tokens))
      choice.read_at = now
    if choice.logprobs is not None and update.tokens:
      choice.logprobs.add(update.tokens, update.logprobs or [])
    choice.text += update.text
    if update.finish_reason is not None:
      choice.last = update
      metrics.observe("e2e_request_latency_seconds", now - choice.job.arrived)
      metrics.observe("request_queue_time_seconds", update.queue_seconds)
    return choice, update

  async def whole(self, request: fastapi.Request) -> JSONResponse:
    """Wait for every answer, cancelling the jobs as soon as the client leaves."""
    left = asyncio.ensure_future(_disconnected(request))
    try:
      while not self.done:
        update = asyncio.ensure_future(self._next())
        await asyncio.wait({update, left}, return_when=asyncio.FIRST_COMPLETED)
        if not update.done():
          update.cancel()
          self._left()
          return JSONResponse({}, status_code=499)
        try:
          update.result()
        except APIError:
          self._cancel()
          raise
    finally:
      left.cancel()
    self._finished()
    fields = dict(id=self.request_id, created=self.created, model=self.state.model_name, usage=_usage(self.choices))
    stats = [self.state.stats(c.job, c.last) for c in self.choices]
    if len(stats) == 1:
      fields["refusion"] = stats[0]
    if self.chat:
      choices = [
        schemas.ChatChoice(
          index=c.index,
          message=schemas.AssistantMessage(content=c.text),
          logprobs=self._chat_logprobs(c.logprobs.take(c.text, final=True)) if c.logprobs else None,
          finish_reason=c.last.finish_reason,
          refusion=s,
        )
        for c, s in zip(self.choices, stats)
      ]
      response = schemas.ChatCompletionResponse(choices=choices, **fields)
    else:
      choices = [
        schemas.CompletionChoice(
          index=c.index,
          text=c.text,
          logprobs=self._completion_logprobs(c.logprobs.take(c.text, final=True)) if c.logprobs else None,
          finish_reason=c.last.finish_reason,
          refusion=s,
        )
        for c, s in zip(self.choices, stats)
      ]
      response = schemas.CompletionResponse(choices=choices, **fields)
    return JSONResponse(response.model_dump(), headers={"X-Request-Id": self.request_id})

  def _chat_logprobs(self, tokens: list[TokenLogprob]) -> schemas.ChatLogprobs:
    tokenizer = self.state.tokenizer
    return schemas.ChatLogprobs(
      content=[
        schemas.TokenLogprob(token=t.text, logprob=t.logprob, bytes=token_bytes(tokenizer, t.token)) for t in tokens
      ]
    )

  @staticmethod
  def _completion_logprobs(tokens: list[TokenLogprob]) -> schemas.CompletionLogprobs:
    return schemas.CompletionLogprobs(
      tokens=[t.text for t in tokens],
      token_logprobs=[t.logprob for t in tokens],
      text_offset=[t.offset for t in tokens],
      top_logprobs=[{t.text: t.logprob} for t in tokens],
    )

  def _chunk(self, choice: _Choice, text: str | None, finish: Update | None = None, role: bool = False) -> str:
    """One event of `choice`: `text` (chat: as a delta) with the log-probabilities of the tokens it completes, and
    on its last event the finish reason and our statistics (and the usage, when the request has one answer and
    did not ask for a usage chunk)."""
    reason = finish.finish_reason if finish else None
    fields = dict(id=self.request_id, created=self.created, model=self.state.model_name)
    if finish:
      fields["refusion"] = self.state.stats(choice.job, finish)
      if len(self.choices) == 1 and not self.include_usage:
        fields["usage"] = _usage(self.choices)
    tokens = choice.logprobs.take(choice.text, final=finish is not None) if choice.logprobs and not role else []
    if self.chat:
      delta = schemas.Delta(role="assistant" if role else None, content=text)
      logprobs = self._chat_logprobs(tokens) if tokens else None
      chunk = schemas.ChatCompletionChunk(
        choices=[schemas.ChatChunkChoice(index=choice.index, delta=delta, logprobs=logprobs, finish_reason=reason)],
        **fields,
      )
    else:
      logprobs = self._completion_logprobs(tokens) if tokens else None
      chunk = schemas.CompletionResponse(
        choices=[
          schemas.CompletionChoice(index=choice.index, text=text or "", logprobs=logprobs, finish_reason=reason)
        ],
        **fields,
      )
    return sse.event(chunk)

  def _usage_chunk(self) -> str:
    """OpenAI's last chunk under `stream_options.include_usage`: the usage, no choices."""
    fields = dict(id=self.request_id, created=self.created, model=self.state.model_name, usage=_usage(self.choices))
    chunk = (
      schemas.ChatCompletionChunk(choices=[], **fields)
      if self.chat
      else schemas.CompletionResponse(choices=[], **fields)
    )
    return sse.event(chunk)

  async def events(self) -> AsyncIterator[str]:
    """The answers as OpenAI streams them; a client that leaves (the generator is closed) cancels the jobs."""
    done = False
    try:
      if self.chat:
        for choice in self.choices:
          yield self._chunk(choice, "", role=True)
      while not self.done:
        try:
          choice, update = await self._next()
        except APIError as error:  # the headers are sent: the error goes as an event, as OpenAI sends it
          self._cancel()
          yield sse.event(error.body())
          done = True
          self.state.metrics.count_request(self.route, error.status)
          log_request(self.request_id, self.route, error.status, error=error.code or error.type)
          return
        if update.finish_reason is not None:
          yield self._chunk(choice, update.text or (None if self.chat else ""), finish=update)
        elif update.text:
          yield self._chunk(choice, update.text)
      done = True
      self._finished()
      if self.include_usage:
        yield self._usage_chunk()
      yield sse.DONE
    finally:
      if not done:
        self._left()

  def _finished(self) -> None:
    """Count and log a request that got all its answers."""
    metrics, choices = self.state.metrics, self.choices
    metrics.count_request(self.route, 200)
    usage = _usage(choices)
    metrics.add("prompt_tokens_total", usage.prompt_tokens)
    metrics.add("answer_tokens_total", usage.completion_tokens)
    metrics.add("forwards_total", sum(c.last.forwards for c in choices))
    arrived = min(c.job.arrived for c in choices)
    log_request(
      self.request_id,
      self.route,
      200,
      choices=len(choices) if len(choices) > 1 else None,
      prompt_tokens=usage.prompt_tokens,
      answer_tokens=usage.completion_tokens,
      finish=",".join(sorted({c.last.finish_reason for c in choices})),
      queue_s=max(c.last.queue_seconds for c in choices),
      first_text_s=None if self.first_text is None else self.first_text - arrived,
      decode_s=max(c.last.decode_seconds for c in choices),
      total_s=time.perf_counter() - arrived,
    )

  def _cancel(self) -> None:
    for choice in self.choices:
      self.state.worker.cancel(choice.job)

  def _left(self) -> None:
    """The client disconnected before the answers ended: free their rows, count and log it (499, nginx's code)."""
    self._cancel()
    self.state.metrics.count_request(self.route, 499)
    log_request(self.request_id, self.route, 499, error="client_disconnected")
