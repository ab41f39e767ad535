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

import jax
import uvicorn

from refusion_jax.data.tokenizer import Tokenizer
from refusion_jax.decoding.compilations import compilations
from refusion_jax.decoding.contract import Method
from refusion_jax.decoding.engine import Engine
from refusion_jax.decoding.loop import compile_count
from refusion_jax.decoding.prompts import bucket_length
from refusion_jax.decoding.sampler import Sampler
from refusion_jax.model.transformer import Transformer
from refusion_jax.serving.app import create_app
from refusion_jax.serving.worker import DecodeWorker, Job

logger = logging.getLogger("refusion_jax.serving")


@dataclasses.dataclass(frozen=True)
class ServerOptions:
  """What `python -m refusion_jax.serve` sets (its flags say what each means)."""

  method: Method
  rows: int
  max_prompt_tokens: int
  max_queue: int
  chunk_iterations: int
  model_name: str
  seed: int | None = None
  special_ids: dict[str, int | None] = dataclasses.field(default_factory=dict)
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


def start_worker(
  model: Transformer, tokenizer: Tokenizer, options: ServerOptions, mesh: jax.sharding.Mesh | None = None
) -> DecodeWorker:
  """The started, warmed decode worker: `options.rows` rows for prompts up to `options.max_prompt_tokens`,
  with the special ids a `Sampler` of this tokenizer uses."""
  special_ids = Sampler(model, tokenizer, options.method, **options.special_ids).special_ids
  engine = Engine(
    model,
    options.method,
    rows=options.rows,
    prompt_width=bucket_length(options.max_prompt_tokens),
    mesh=mesh,
    sampling=True,  # requests bring their own temperatures
    **special_ids,
  )
  worker = DecodeWorker(
    engine, tokenizer, max_queue=options.max_queue, chunk_iterations=options.chunk_iterations, seed=options.seed
  )
  worker.start()
  warm_up(worker, model.config.vocab_size)
  return worker


def build_server(
  model: Transformer,
  tokenizer: Tokenizer,
  options: ServerOptions,
  *,
  mesh: jax.sharding.Mesh | None = None,
  host: str = "127.0.0.1",
  port: int = 8000,
) -> Server:
  """The server, ready to `run()`: engine compiled and warmed, app built, what it serves logged."""
  worker = start_worker(model, tokenizer, options, mesh)
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
