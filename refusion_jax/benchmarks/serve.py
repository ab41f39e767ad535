"""What `python -m refusion_jax.bench serve` runs: the OpenAI server under N concurrent streaming clients, against
the same prompts through the `Sampler` one by one and with K rows, in one run.

The server runs in this process (uvicorn on a thread, the model loaded once),
on 127.0.0.1 with a free port; the clients are asyncio tasks over HTTP, at
most `clients` in flight, each asking one prompt greedily (temperature 0), so
every mode's answers can be compared with the one-by-one Sampler's. Per mode:
requests/s, answer tokens/s, p50/p99 latency (arrival to last byte) and, for
the server, p50/p99 time to the first streamed text. The modes are timed by
`benchmarks.timer`: a warm-up pass each (what it compiles), then `repeats`
interleaved rounds over all the prompts; rates are of the median round, the
latencies of the last.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import threading
import time
from collections.abc import Iterator, Sequence

import httpx
import numpy as np

from refusion_jax.benchmarks.table import spread, table
from refusion_jax.benchmarks.timer import Timing, log, time_rounds
from refusion_jax.data.tokenizer import Tokenizer
from refusion_jax.decoding.contract import Method
from refusion_jax.decoding.options import DecodeOptions
from refusion_jax.decoding.sampler import Sampler
from refusion_jax.model.transformer import Transformer
from refusion_jax.serving.server import ServerOptions, build_server

# Random prompts are drawn from these words (any tokenizer encodes them), 1 to 12 words each.
WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "then", "what", "is", "2", "+", "3", "=", "?")


@dataclasses.dataclass(frozen=True)
class ServeBenchOptions:
  """The load: N prompts from C clients at most in flight, K rows, prompts up to P tokens."""

  prompts: int = 64
  clients: int = 16
  rows: int = 8
  max_prompt_tokens: int = 64
  chunk_iterations: int = 8
  seed: int = 0
  repeats: int = 1  # timed rounds after the warm-up (benchmarks.timer)


@dataclasses.dataclass(frozen=True)
class ServeBenchRow:
  """One mode's measurement (latencies in seconds, of the last round; time to first text only where a mode
  streams)."""

  mode: str
  timing: Timing  # of a pass over all the prompts
  answer_tokens: int
  latencies: tuple[float, ...]
  first_text: tuple[float, ...] = ()
  same_texts: int = 0

  @property
  def seconds(self) -> float:
    """The median pass."""
    return self.timing.median

  @property
  def requests_per_s(self) -> float:
    return len(self.latencies) / self.seconds

  @property
  def tokens_per_s(self) -> float:
    return self.answer_tokens / self.seconds


def bench_prompts(count: int, seed: int) -> list[str]:
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 13)))) for _ in range(count)]


def _free_port() -> int:
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    return probe.getsockname()[1]


async def _ask(
  http: httpx.AsyncClient, gate: asyncio.Semaphore, prompt: str, model: str
) -> tuple[str, int, float, float]:
  """One streamed completion: (text, answer tokens, latency, time to first text)."""
  async with gate:
    start, first, texts, tokens = time.perf_counter(), None, [], 0
    body = dict(model=model, prompt=prompt, temperature=0, stream=True)
    async with http.stream("POST", "/v1/completions", json=body) as reply:
      reply.raise_for_status()
      async for line in reply.aiter_lines():
        if not line.startswith("data: {"):
          continue
        chunk = json.loads(line[len("data: ") :])
        text = chunk["choices"][0]["text"]
        if text and first is None:
          first = time.perf_counter() - start
        texts.append(text)
        tokens = chunk.get("usage", {}).get("completion_tokens", tokens)
    latency = time.perf_counter() - start
    return "".join(texts), tokens, latency, latency if first is None else first


# A pass over the prompts: (texts, answer tokens, latencies, times to first text: empty where a mode streams none).
Pass = tuple[list[str], int, tuple[float, ...], tuple[float, ...]]


@contextlib.contextmanager
def _running_server(
  model: Transformer, tokenizer: Tokenizer, method: Method, options: ServeBenchOptions
) -> Iterator[int]:
  """The server on a thread of this process while the block runs; yields its port."""
  port = _free_port()
  server_options = ServerOptions(
    method=method,
    decode=DecodeOptions(rows=options.rows, chunk_iterations=options.chunk_iterations),
    max_prompt_tokens=options.max_prompt_tokens,
    max_queue=options.prompts,
    model_name="bench",
    seed=options.seed,
    log_level="warning",
  )
  server = build_server(model, tokenizer, server_options, port=port)
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  while not server.started:
    time.sleep(0.05)
  try:
    yield port
  finally:
    server.should_exit = True
    thread.join()


def _served(port: int, prompts: Sequence[str], clients: int) -> Pass:
  """Every prompt as a streamed request, at most `clients` in flight."""

  async def load() -> list:
    gate = asyncio.Semaphore(clients)
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits) as http:
      return await asyncio.gather(*(_ask(http, gate, p, "bench") for p in prompts))

  texts, tokens, latencies, first = zip(*asyncio.run(load()))
  return list(texts), sum(tokens), latencies, first


def _one_by_one(sampler: Sampler, prompts: Sequence[str]) -> Pass:
  texts, tokens, latencies = [], 0, []
  for prompt in prompts:
    begin = time.perf_counter()
    (text,), result = sampler.generate([prompt])
    latencies.append(time.perf_counter() - begin)
    texts.append(text)
    tokens += len(result.tokens[0])
  return texts, tokens, tuple(latencies), ()


def _batched(sampler: Sampler, prompts: Sequence[str]) -> Pass:
  begin = time.perf_counter()
  texts, result = sampler.generate(prompts)
  seconds = time.perf_counter() - begin
  return texts, sum(len(t) for t in result.tokens), (seconds,) * len(prompts), ()


def run_serve_bench(
  model: Transformer, tokenizer: Tokenizer, method: Method, options: ServeBenchOptions
) -> list[ServeBenchRow]:
  """The three modes over the same prompts, each after a warm-up pass that compiles what it runs: Sampler one by
  one (prompts padded to their own buckets), Sampler with K rows (to the longest prompt's), the server under
  `options.clients` clients (to the bucket of `options.max_prompt_tokens`)."""
  prompts = bench_prompts(options.prompts, options.seed)
  one = Sampler(model, tokenizer, method, seed=options.seed)
  batched = Sampler(model, tokenizer, method, rows=options.rows, seed=options.seed)
  log(f"{len(prompts)} prompts; the server under {options.clients} clients")
  with _running_server(model, tokenizer, method, options) as port:
    calls = {
      "sampler one by one": lambda: _one_by_one(one, prompts),
      f"sampler, K={options.rows}": lambda: _batched(batched, prompts),
      f"server, {options.clients} clients, K={options.rows}": lambda: _served(port, prompts, options.clients),
    }
    passes, timings = time_rounds(calls, options.repeats)
  reference = passes["sampler one by one"][0]
  return [
    ServeBenchRow(
      mode,
      timings[mode],
      tokens,
      latencies,
      first,
      same_texts=sum(a == b for a, b in zip(texts, reference)),
    )
    for mode, (texts, tokens, latencies, first) in passes.items()
  ]


def format_serve(rows: Sequence[ServeBenchRow]) -> str:
  """The serving table: each mode's rates and latency percentiles, and its speed over the first (one by one)."""
  percentile = lambda values, q: f"{np.percentile(values, q):.3f}" if values else "-"
  header = ("mode", "s", "spread", "requests/s", "answer tokens/s", "p50 s", "p99 s", "p50 first text s")
  header += ("p99 first text s",)
  lines = [
    (
      r.mode,
      f"{r.seconds:.2f}",
      spread(r.timing),
      f"{r.requests_per_s:.2f}",
      f"{r.tokens_per_s:.0f}",
      percentile(r.latencies, 50),
      percentile(r.latencies, 99),
      percentile(r.first_text, 50),
      percentile(r.first_text, 99),
    )
    for r in rows
  ]
  base = rows[0]
  ratios = ", ".join(f"{r.mode} {base.timing.ratio_to(r.timing):.2f}x" for r in rows[1:])
  same = ", ".join(f"{r.mode} {r.same_texts}/{len(r.latencies)}" for r in rows[1:])
  return "\n".join(
    [table(header, lines), "", f"requests/s over {base.mode}: {ratios}.", f"texts equal to {base.mode}'s: {same}."]
  )
