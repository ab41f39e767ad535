"""The server as one object: the decode engine warmed up, the app over it, uvicorn around both.

`build_server` compiles the decode loop for K rows and one prompt bucket, warms
it with requests of mixed lengths, temperatures and seeds (so nothing compiles
once clients come: /metrics shows the count), says what it serves, and
returns a uvicorn server whose SIGTERM first makes the decode worker refuse new
requests (503), then lets held ones finish within `shutdown_seconds`, then
ends what is left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from refusion_jax.data.tokenizer import Tokenizer
from refusion_jax.decoding.compilations import compilations
from refusion_jax.decoding.contract import Method
from refusion_jax.decoding.engine import Engine
from refusion_jax.decoding.loop import compile_count
from refusion_jax.decoding.options import DecodeOptions
from refusion_jax.decoding.prompts import bucket_length
from refusion_jax.model.transformer import Transformer
from refusion_jax.serving.app import create_app
from refusion_jax.serving.worker import DecodeWorker, Job

logger = logging.getLogger("refusion_jax.serving")


@dataclasses.dataclass(frozen=True)
class ServerOptions:
  """What `python -m refusion_jax.serve` sets (its flags say what each means).

  `decode` is how the engine decodes (`DecodeOptions`: its rows K, special ids, mesh and `chunk_iterations`, the
  loop iterations per call, are required to be set here); `seed` is the sampling seed of requests that give none
  (None: a new random one for each).
  """

  method: Method
  decode: DecodeOptions
  max_prompt_tokens: int
  max_queue: int
  model_name: str
  seed: int | None = None
  api_key: str | None = None
  max_body_bytes: int = 1 << 20
  shutdown_seconds: int = 30
  log_level: str = "info"


class Server(uvicorn.Server):
  """uvicorn's server; a stop signal first turns new requests away (the decode worker drains)."""

  def __init__(self, config: uvicorn.Config, worker: DecodeWorker):
    super().__init__(config)
    self.worker = worker

  def handle_exit(self, sig: int, frame: Any) -> None:
    self.worker.drain()
    super().handle_exit(sig, frame)


def warm_up(worker: DecodeWorker, vocab_size: int) -> None:
  """Run requests through every path a client can take: prompt lengths 1 and the bucket's, greedy and sampled,
  a stop string, a cancelled request; returns once all ended."""
  longest = worker.max_prompt_tokens
  requests = [(1, 0.0, 0), (longest, 0.7, 1), (max(1, longest // 3), 1.3, 2), (2, 0.0, 3)]
  done = threading.Semaphore(0)

  def job(length: int, temperature: float, seed: int) -> Job:
    ids = [(7 * i + seed) % vocab_size for i in range(length)]
    deliver = lambda update: done.release() if update.finish_reason or update.error else None
    return Job(ids, worker.token_limit(None), temperature, seed, ("\n\n",), deliver)

  jobs = [job(*r) for r in requests]
  for j in jobs:
    worker.submit(j)
  cancelled = job(3, 0.5, 4)
  worker.submit(cancelled)
  worker.cancel(cancelled)
  for _ in jobs:
    done.acquire()


def start_worker(model: Transformer, tokenizer: Tokenizer, options: ServerOptions) -> DecodeWorker:
  """The started, warmed decode worker: `options.decode.rows` rows for prompts up to `options.max_prompt_tokens`,
  with the special ids a `Sampler` of this tokenizer uses."""
  decode = options.decode
  if decode.rows is None or decode.chunk_iterations is None:
    raise ValueError("A server's decode options need rows and chunk_iterations set (e.g. rows=8, chunk_iterations=8).")
  decode = decode.with_tokenizer_ids(tokenizer, model.config)
  prompt_width = bucket_length(options.max_prompt_tokens)
  engine = Engine(model, options.method, decode, prompt_width=prompt_width, sampling=True)  # requests' temperatures
  worker = DecodeWorker(
    engine, tokenizer, max_queue=options.max_queue, chunk_iterations=decode.chunk_iterations, seed=options.seed
  )
  worker.start()
  warm_up(worker, model.config.vocab_size)
  return worker


def build_server(
  model: Transformer,
  tokenizer: Tokenizer,
  options: ServerOptions,
  *,
  host: str = "127.0.0.1",
  port: int = 8000,
) -> Server:
  """The server, ready to `run()`: engine compiled and warmed, app built, what it serves logged."""
  worker = start_worker(model, tokenizer, options)
  warm_loop, warm_all = compile_count(), compilations()
  gauges = {
    "compilations_since_warmup": (
      "XLA compilations of the decode loop since the warm-up (0 when every request reuses it).",
      lambda: compile_count() - warm_loop,
    ),
    "compilations_all_since_warmup": (
      "Every XLA compilation in the process since the warm-up.",
      lambda: compilations() - warm_all,
    ),
    "compilations_total": ("XLA compilations of the decode loop, the warm-up's included.", compile_count),
  }

  @contextlib.asynccontextmanager
  async def lifespan(app: Any) -> AsyncIterator[None]:
    yield
    worker.stop(timeout=options.shutdown_seconds)

  app = create_app(
    worker,
    tokenizer,
    options.model_name,
    api_key=options.api_key,
    max_body_bytes=options.max_body_bytes,
    gauges=gauges,
    lifespan=lifespan,
  )
  method = options.method
  logger.info(
    "serving %r on http://%s:%d: %s, %d rows, prompts up to %d tokens (one compiled bucket), answers up to %d "
    "tokens in steps of %d; %d decode-loop compilations at warm-up, /metrics counts any later one%s",
    options.model_name,
    host,
    port,
    method,
    worker.engine.rows,
    worker.max_prompt_tokens,
    worker.gen_length,
    worker.token_grid,
    warm_loop,
    "; API key required" if options.api_key else "",
  )
  # uvicorn's access log is off: every request gets our line with its id and timings (`serving.request_log`).
  config = uvicorn.Config(
    app,
    host=host,
    port=port,
    timeout_graceful_shutdown=options.shutdown_seconds,
    log_level=options.log_level,
    access_log=False,
    lifespan="on",
  )
  return Server(config, worker)
