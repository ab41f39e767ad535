"""The server as one object: the decode engines warmed up, the app over them, uvicorn around both.

`build_server` compiles a decode loop for each bucket of a ladder of prompt
buckets (`decoding.ladder.EngineLadder`: one placement of the weights, one
prefix cache), warms each with requests of mixed lengths, temperatures and
seeds (so nothing compiles once clients come: /metrics shows the count), says
what it serves, and returns a uvicorn server whose SIGTERM first makes the
decode worker refuse new requests (503), then lets held ones finish within
`shutdown_seconds`, then ends what is left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn

from refusion_jax.data.tokenizer import Tokenizer
from refusion_jax.decoding.compilations import compilations
from refusion_jax.decoding.contract import Method
from refusion_jax.decoding.ladder import EngineLadder, check_ladder, default_bucket_rows, default_buckets
from refusion_jax.decoding.loop import compile_count
from refusion_jax.decoding.options import DecodeOptions
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer
from refusion_jax.serving.app import create_app
from refusion_jax.serving.worker import DecodeWorker, Job

logger = logging.getLogger("refusion_jax.serving")


@dataclasses.dataclass(frozen=True)
class ServerOptions:
  """What `python -m refusion_jax.serve` sets (its flags say what each means).

  `decode` is how the engines decode (`DecodeOptions`: its rows K, special ids, mesh and `chunk_iterations`, the
  loop iterations per call, are required to be set here; its `prefix_cache_tokens` the prefix cache's size);
  `max_prompt_tokens` the longest prompt (None: what fits the model's context with an answer of G tokens);
  `prompt_buckets` the ladder (None: `ladder.default_buckets`) and `bucket_rows` each bucket's rows (None:
  `ladder.default_bucket_rows` of K); `seed` is the sampling seed of requests that give none (None: a new random
  one for each).
  """

  method: Method
  decode: DecodeOptions
  max_prompt_tokens: int | None
  max_queue: int
  model_name: str
  seed: int | None = None
  prompt_buckets: tuple[int, ...] | None = None
  bucket_rows: tuple[int, ...] | None = None
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
  """Run requests through every path a client can take: every prompt bucket's loop at its longest prompt, a
  prompt of one token, greedy and sampled, a stop string, a cancelled request, prompts sharing a prefix (the same
  token sequence cut at several lengths); returns once all ended."""
  longest = worker.max_prompt_tokens
  requests = [(1, 0.0, 0), (max(1, longest // 3), 1.3, 2), (2, 0.0, 3)]
  requests += [(min(bucket, longest), 0.7, 1) for bucket in worker.engine.buckets]
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


def prompt_ladder(options: ServerOptions, config: ModelConfig) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
  """The longest prompt, the prompt buckets and their rows the server compiles: `options`' or the defaults
  (`ServerOptions`).

  Raises:
    ValueError: a longest prompt that leaves no room for the answer in the model's context, or a ladder that
      does not end at it.
  """
  gen_length = options.method.gen_length
  context = config.max_position_embeddings
  longest = context - gen_length if options.max_prompt_tokens is None else options.max_prompt_tokens
  if longest < 1 or longest + gen_length > context:
    raise ValueError(
      f"Prompts of up to {longest} tokens and answers of {gen_length} do not fit the model's context of {context} "
      f"positions; give --max_prompt_tokens at most {context - gen_length} (or a shorter --gen_length)."
    )
  buckets = options.prompt_buckets or default_buckets(longest)
  if buckets[-1] < longest:
    raise ValueError(
      f"The largest prompt bucket, {buckets[-1]}, is shorter than --max_prompt_tokens {longest}; end "
      f"--prompt_buckets with a bucket of at least {longest} tokens."
    )
  rows = options.bucket_rows or default_bucket_rows(buckets, options.decode.rows, gen_length)
  check_ladder(buckets, rows)
  return longest, tuple(buckets), tuple(rows)


def start_worker(model: Transformer, tokenizer: Tokenizer, options: ServerOptions) -> DecodeWorker:
  """The started, warmed decode worker: a ladder of prompt buckets (`prompt_ladder`) with the special ids a
  `Sampler` of this tokenizer uses."""
  decode = options.decode
  if decode.rows is None or decode.chunk_iterations is None:
    raise ValueError("A server's decode options need rows and chunk_iterations set (e.g. rows=8, chunk_iterations=8).")
  decode = decode.with_tokenizer_ids(tokenizer, model.config)
  longest, buckets, rows = prompt_ladder(options, model.config)
  # Requests bring their temperatures: every engine samples.
  engine = EngineLadder(
    model, options.method, decode, buckets=buckets, bucket_rows=rows, sampling=True, max_prompt_tokens=longest
  )
  worker = DecodeWorker(
    engine, tokenizer, max_queue=options.max_queue, chunk_iterations=decode.chunk_iterations, seed=options.seed
  )
  engine.compile(decode.chunk_iterations)  # every bucket's loop on threads at once, before the warm-up runs them
  worker.start()
  warm_up(worker, model.config.vocab_size)
  return worker


def ladder_gauges(ladder: EngineLadder) -> dict[str, tuple[str, Callable[[], float]]]:
  """/metrics gauges of the prompt buckets (their count, and each one's rows) and of the prefix cache (its
  counters in vLLM's words: prompt tokens queried and taken from the cache, and its blocks)."""
  gauges: dict[str, tuple[str, Callable[[], float]]] = {
    "prompt_buckets": ("Prompt buckets compiled at warm-up (each its own decode loop).", lambda: len(ladder.buckets)),
    "max_prompt_tokens": ("The longest prompt served (--max_prompt_tokens).", lambda: ladder.prompt_width),
  }
  for bucket, rows in zip(ladder.buckets, ladder.bucket_rows):
    gauges[f"prompt_bucket_{bucket}_rows"] = (
      f"Rows of the decode loop for prompts of up to {bucket} tokens.",
      lambda r=rows: r,
    )
  cache = ladder.prefix_cache
  helps = {
    "prefix_cache_queries": "Prompt tokens admitted while the prefix cache is on (vLLM's prefix_cache_queries).",
    "prefix_cache_hits": "Prompt tokens whose KV was taken from the prefix cache (vLLM's prefix_cache_hits).",
    "prefix_cache_requests": "Prompts admitted while the prefix cache is on.",
    "prefix_cache_hit_requests": "Prompts that took at least one block from the prefix cache.",
    "prefix_cache_blocks": "Blocks of 16 prompt tokens the prefix cache holds at most (0: off).",
    "prefix_cache_blocks_used": "Blocks of the prefix cache in use.",
  }
  for name, help_text in helps.items():
    gauges[name] = (help_text, (lambda: 0) if cache is None else (lambda name=name: cache.stats[name]))
  return gauges


def _mib(count: int) -> str:
  return f"{count / 2**20:.1f} MiB"


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
    **ladder_gauges(worker.engine),
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
  ladder = worker.engine
  cache = ladder.prefix_cache
  logger.info(
    "serving %r on http://%s:%d: %s; prompts up to %d tokens in buckets %s (rows %s: %s of KV cache), answers up "
    "to %d tokens in steps of %d; prefix cache %s; %d decode-loop compilations at warm-up, /metrics counts any "
    "later one%s",
    options.model_name,
    host,
    port,
    method,
    worker.max_prompt_tokens,
    ",".join(map(str, ladder.buckets)),
    ",".join(map(str, ladder.bucket_rows)),
    _mib(ladder.cache_bytes),
    worker.gen_length,
    worker.token_grid,
    "off" if cache is None else f"of {cache.tokens} tokens ({_mib(cache.pool_bytes)})",
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
