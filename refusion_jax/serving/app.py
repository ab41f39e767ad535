"""The FastAPI app: OpenAI's `/v1/completions`, `/v1/chat/completions` and `/v1/models`, plus `/health`, `/metrics`.

Every request is bounded before any work: the key (`serving.auth`, all paths
but /health), the body size (413), the body's fields (`serving.schemas`, 400),
the prompt's length (400, it must fit the prompt bucket the server compiled).
Then it becomes a `serving.worker.Job`; the worker's thread delivers its text
increments through an asyncio queue, as one response or as server-sent events
(`serving.sse`). A client that disconnects cancels its job, which frees its
row at the next loop-call boundary. Errors are OpenAI's error object
(`serving.errors`); each request is logged once with its id and timings
(`serving.request_log`) and counted in /metrics.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import fastapi
import pydantic
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from refusion_jax.data.chat import render_messages
from refusion_jax.data.tokenizer import Tokenizer
from refusion_jax.decoding.stop_strings import check_stop_strings
from refusion_jax.serving import schemas, sse
from refusion_jax.serving.auth import check_authorization
from refusion_jax.serving.errors import APIError, bad_request
from refusion_jax.serving.metrics import CONTENT_TYPE, Metrics
from refusion_jax.serving.request_log import log_request
from refusion_jax.serving.worker import DecodeWorker, Job, Update

# Request bodies above this many bytes are refused with 413 unless the server says otherwise.
DEFAULT_MAX_BODY_BYTES = 1 << 20
# How often a non-streamed request checks whether its client is still there.
DISCONNECT_POLL_SECONDS = 0.5


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
      self.metrics.count_request(scope["path"], error.status)
      log_request("-", scope["path"], error.status, error=error.code or error.type)
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


class ServerState:
  """What the endpoints share: the decode worker, the tokenizer, the served name and the limits."""

  def __init__(self, worker: DecodeWorker, tokenizer: Tokenizer, model_name: str, metrics: Metrics):
    self.worker, self.tokenizer, self.model_name, self.metrics = worker, tokenizer, model_name, metrics
    self.created = int(time.time())

  def prompt_ids(self, prompt: str | list[int]) -> list[int]:
    """The prompt's token ids, checked against the vocabulary and the prompt bucket."""
    try:
      ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    except ValueError as error:  # a checkpoint without a tokenizer takes token ids only
      raise bad_request(str(error), param="prompt") from None
    if not ids:
      raise bad_request("The prompt is empty after tokenisation; give at least one character.", param="prompt")
    vocab = self.worker.engine.config.vocab_size
    if any(not 0 <= token < vocab for token in ids):
      raise bad_request(f"Prompt token ids must lie in [0, {vocab}).", param="prompt")
    if len(ids) > self.worker.max_prompt_tokens:
      raise bad_request(
        f"The prompt has {len(ids)} tokens; this server takes at most {self.worker.max_prompt_tokens} "
        "(its prompt bucket, --max_prompt_tokens): shorten the prompt.",
        param="prompt",
        code="context_length_exceeded",
      )
    return ids

  def check_model(self, model: str) -> None:
    if model != self.model_name:
      raise bad_request(
        f"The model {model!r} is not served here; use {self.model_name!r} (GET /v1/models).",
        param="model",
        code="model_not_found",
      )

  def job(self, body: schemas.GenerationRequest, ids: list[int], deliver: Callable[[Update], None]) -> Job:
    """The worker's job for a checked request: its stop strings checked, its token limit applied."""
    try:
      stops = check_stop_strings(body.stop)
    except ValueError as error:
      raise bad_request(str(error), param="stop") from None
    limit = self.worker.token_limit(body.max_tokens)
    return Job(ids, limit, body.temperature, body.seed, stops, deliver)

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
    )

  def finished(self, request_id: str, endpoint: str, job: Job, last: Update, first_text: float | None) -> None:
    """Count and log a request that got its whole answer."""
    self.metrics.count_request(endpoint, 200)
    self.metrics.add("prompt_tokens_total", len(job.prompt_ids))
    self.metrics.add("answer_tokens_total", last.answer_tokens)
    self.metrics.add("forwards_total", last.forwards)
    log_request(
      request_id,
      endpoint,
      200,
      prompt_tokens=len(job.prompt_ids),
      answer_tokens=last.answer_tokens,
      finish=last.finish_reason,
      queue_s=last.queue_seconds,
      first_text_s=None if first_text is None else first_text - job.arrived,
      decode_s=last.decode_seconds,
      total_s=time.perf_counter() - job.arrived,
    )


def _usage(job: Job, last: Update) -> schemas.Usage:
  prompt = len(job.prompt_ids)
  return schemas.Usage(
    prompt_tokens=prompt, completion_tokens=last.answer_tokens, total_tokens=prompt + last.answer_tokens
  )


def create_app(
  worker: DecodeWorker,
  tokenizer: Tokenizer,
  model_name: str,
  *,
  api_key: str | None = None,
  max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
  gauges: dict[str, tuple[str, Callable[[], float]]] | None = None,
  lifespan: Callable[[Any], Any] | None = None,
) -> Any:
  """The server's app over a started decode `worker` (the caller starts and stops it; see `refusion_jax.serve`).

  Args:
    model_name: the one model id the server answers to.
    api_key: require `Authorization: Bearer <api_key>` on every path but /health (None: open).
    max_body_bytes: larger request bodies get 413.
    gauges: more /metrics gauges (name -> (help, read)), besides queue depth and rows busy.
    lifespan: the app's lifespan (FastAPI's), e.g. stopping the worker when the server stops.

  Returns:
    The ASGI app (FastAPI's, behind the key and body-size guard).
  """
  metrics = Metrics(
    {
      "queue_depth": ("Requests waiting for a row.", lambda: worker.queue_depth),
      "rows_busy": ("Rows decoding a request.", lambda: worker.rows_busy),
      "rows": ("Rows of the decode loop (K).", lambda: worker.engine.rows),
      **(gauges or {}),
    }
  )
  worker.metrics = metrics
  state = ServerState(worker, tokenizer, model_name, metrics)
  app = fastapi.FastAPI(title="refusion_jax", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

  @app.exception_handler(APIError)
  async def api_error(request: fastapi.Request, error: APIError) -> JSONResponse:
    metrics.count_request(request.url.path, error.status)
    log_request(
      getattr(request.state, "request_id", "-"), request.url.path, error.status, error=error.code or error.type
    )
    return _error_response(error)

  @app.exception_handler(Exception)
  async def failure(request: fastapi.Request, error: Exception) -> JSONResponse:
    return await api_error(request, APIError(500, f"The server failed: {error}", type="server_error"))

  @app.get("/health")
  async def health() -> JSONResponse:
    if worker.draining:
      return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})

  @app.get("/metrics")
  async def prometheus() -> PlainTextResponse:
    return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)

  @app.get("/v1/models")
  async def models() -> JSONResponse:
    card = schemas.ModelCard(
      id=model_name,
      created=state.created,
      max_prompt_tokens=worker.max_prompt_tokens,
      gen_length=worker.gen_length,
      token_grid=worker.token_grid,
    )
    return JSONResponse(schemas.ModelList(data=[card]).model_dump())

  async def serve(request: fastapi.Request, chat: bool) -> Any:
    """A completion (`chat` False) or chat completion request, from its body to its response."""
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    request.state.request_id = request_id
    raw = await _read_body(request, max_body_bytes)
    body = _parse(schemas.ChatCompletionRequest if chat else schemas.CompletionRequest, raw)
    state.check_model(body.model)
    body.unsupported()
    if chat:
      messages = [dict(role=m.role, content=m.text()) for m in body.messages]
      ids = state.prompt_ids(render_messages(tokenizer, messages))
    else:
      ids = state.prompt_ids(body.one_prompt())
    updates: asyncio.Queue[Update] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    job = state.job(body, ids, lambda update: loop.call_soon_threadsafe(updates.put_nowait, update))
    worker.submit(job)
    reply = _Reply(state, request_id, request.url.path, job, chat)
    if body.stream:
      return StreamingResponse(reply.events(updates), media_type=sse.MEDIA_TYPE, headers={"X-Request-Id": request_id})
    return await reply.whole(updates, request)

  @app.post("/v1/completions")
  async def completions(request: fastapi.Request) -> Any:
    return await serve(request, chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: fastapi.Request) -> Any:
    return await serve(request, chat=True)

  return _Guard(app, api_key, max_body_bytes, metrics)


class _Reply:
  """One request's answer, as one JSON body or as server-sent events."""

  def __init__(self, state: ServerState, request_id: str, endpoint: str, job: Job, chat: bool):
    self.state, self.request_id, self.endpoint, self.job, self.chat = state, request_id, endpoint, job, chat
    self.created = int(time.time())
    self.first_text: float | None = None

  async def _next(self, updates: asyncio.Queue[Update]) -> Update:
    update = await updates.get()
    if update.error is not None:
      raise update.error
    if update.text and self.first_text is None:
      self.first_text = time.perf_counter()
    return update

  async def whole(self, updates: asyncio.Queue[Update], request: fastapi.Request) -> JSONResponse:
    """Wait for the whole answer (cancelling the job if the client leaves first)."""
    texts = []
    while True:
      try:
        update = await asyncio.wait_for(self._next(updates), DISCONNECT_POLL_SECONDS)
      except TimeoutError:
        if await request.is_disconnected():
          self._left()
          return JSONResponse({}, status_code=499)
        continue
      texts.append(update.text)
      if update.finish_reason is not None:
        break
    self.state.finished(self.request_id, self.endpoint, self.job, update, self.first_text)
    text, usage, stats = "".join(texts), _usage(self.job, update), self.state.stats(self.job, update)
    fields = dict(id=self.request_id, created=self.created, model=self.state.model_name, usage=usage, refusion=stats)
    if self.chat:
      choice = schemas.ChatChoice(message=schemas.AssistantMessage(content=text), finish_reason=update.finish_reason)
      response = schemas.ChatCompletionResponse(choices=[choice], **fields)
    else:
      choice = schemas.CompletionChoice(text=text, finish_reason=update.finish_reason)
      response = schemas.CompletionResponse(choices=[choice], **fields)
    return JSONResponse(response.model_dump(), headers={"X-Request-Id": self.request_id})

  def _chunk(self, text: str | None, finish: Update | None = None, role: bool = False) -> str:
    """One event: `text` (chat: as a delta), and on the last one the finish reason, usage and our statistics."""
    reason = finish.finish_reason if finish else None
    fields = dict(id=self.request_id, created=self.created, model=self.state.model_name)
    if finish:
      fields.update(usage=_usage(self.job, finish), refusion=self.state.stats(self.job, finish))
    if self.chat:
      delta = schemas.Delta(role="assistant" if role else None, content=text)
      chunk = schemas.ChatCompletionChunk(
        choices=[schemas.ChatChunkChoice(delta=delta, finish_reason=reason)], **fields
      )
    else:
      chunk = schemas.CompletionResponse(
        choices=[schemas.CompletionChoice(text=text or "", finish_reason=reason)], **fields
      )
    return sse.event(chunk)

  async def events(self, updates: asyncio.Queue[Update]) -> AsyncIterator[str]:
    """The answer as OpenAI streams it; a client that leaves (the generator is closed) cancels the job."""
    done = False
    try:
      if self.chat:
        yield self._chunk("", role=True)
      while True:
        try:
          update = await self._next(updates)
        except APIError as error:  # the headers are sent: the error goes as an event, as OpenAI sends it
          yield sse.event(error.body())
          done = True
          self.state.metrics.count_request(self.endpoint, error.status)
          log_request(self.request_id, self.endpoint, error.status, error=error.code or error.type)
          return
        if update.text:
          yield self._chunk(update.text)
        if update.finish_reason is not None:
          done = True
          self.state.finished(self.request_id, self.endpoint, self.job, update, self.first_text)
          yield self._chunk(None if self.chat else "", finish=update)
          yield sse.DONE
          return
    finally:
      if not done:
        self._left()

  def _left(self) -> None:
    """The client disconnected before the answer ended: free its row, count and log it (499, nginx's code)."""
    self.state.worker.cancel(self.job)
    self.state.metrics.count_request(self.endpoint, 499)
    log_request(self.request_id, self.endpoint, 499, error="client_disconnected")
