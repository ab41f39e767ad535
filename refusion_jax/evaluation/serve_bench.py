"""What `python -m refusion_jax.bench serve` runs: the OpenAI server under N concurrent streaming clients, against
the same prompts through the `Sampler` one by one and with K rows, in one run.

The server runs in this process (uvicorn on a thread, the model loaded once),
on 127.0.0.1 with a free port; the clients are asyncio tasks over HTTP, at
most `clients` in flight, each asking one prompt greedily (temperature 0), so
every mode's answers can be compared with the one-by-one Sampler's. Per mode:
requests/s, answer tokens/s, p50/p99 latency (arrival to last byte) and, for
the server, p50/p99 time to the first streamed text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
from collections.abc import Sequence

import httpx
import numpy as np

from refusion_jax.data.tokenizer import Tokenizer
from refusion_jax.decoding.contract import Method
from refusion_jax.decoding.options import DecodeOptions
from refusion_jax.decoding.prompts import bucket_length
from refusion_jax.decoding.sampler import Sampler
from refusion_jax.evaluation.bench_models import log
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


@dataclasses.dataclass(frozen=True)
class ServeBenchRow:
  """One mode's measurement (latencies in seconds; time to first text only where a mode streams)."""

  mode: str
  seconds: float
  answer_tokens: int
  latencies: tuple[float, ...]
  first_text: tuple[float, ...] = ()
  same_texts: int = 0

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


def _serve(
  model: Transformer, tokenizer: Tokenizer, method: Method, options: ServeBenchOptions, prompts: Sequence[str]
) -> tuple[ServeBenchRow, list[str]]:
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

  async def load() -> tuple[float, list]:
    gate = asyncio.Semaphore(options.clients)
    limits = httpx.Limits(max_connections=options.clients)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits) as http:
      start = time.perf_counter()
      answers = await asyncio.gather(*(_ask(http, gate, p, "bench") for p in prompts))
      return time.perf_counter() - start, answers

  try:
    seconds, answers = asyncio.run(load())
  finally:
    server.should_exit = True
    thread.join()
  texts, tokens, latencies, first = zip(*answers)
  row = ServeBenchRow(f"server, {options.clients} clients, K={options.rows}", seconds, sum(tokens), latencies, first)
  return row, list(texts)


def run_serve_bench(
  model: Transformer, tokenizer: Tokenizer, method: Method, options: ServeBenchOptions
) -> list[ServeBenchRow]:
  """The three modes over the same prompts, each after a warm-up that compiles what it runs: Sampler one by one
  (prompts padded to their own buckets), Sampler with K rows (to the longest prompt's), the server under
  `options.clients` clients (to the bucket of `options.max_prompt_tokens`)."""
  prompts = bench_prompts(options.prompts, options.seed)
  one = Sampler(model, tokenizer, method, seed=options.seed)
  buckets = {bucket_length(len(one.encode(p))): p for p in prompts}
  for prompt in buckets.values():  # compiles the one-row program of every prompt bucket
    one(prompt)
  log(f"sampler one by one: {len(prompts)} prompts")
  start, latencies, reference = time.perf_counter(), [], []
  for prompt in prompts:
    begin = time.perf_counter()
    reference.append(one.generate([prompt]))
    latencies.append(time.perf_counter() - begin)
  seconds = time.perf_counter() - start
  texts = [text[0] for text, _ in reference]
  tokens = sum(len(result.tokens[0]) for _, result in reference)
  rows = [ServeBenchRow("sampler one by one", seconds, tokens, tuple(latencies), same_texts=len(prompts))]

  batched = Sampler(model, tokenizer, method, rows=options.rows, seed=options.seed)
  batched(prompts)  # compiles the K-row program
  log(f"sampler with K={options.rows} rows")
  start = time.perf_counter()
  batch_texts, result = batched.generate(prompts)
  seconds = time.perf_counter() - start
  same = sum(a == b for a, b in zip(batch_texts, texts))
  tokens = sum(len(t) for t in result.tokens)
  rows.append(ServeBenchRow(f"sampler, K={options.rows}", seconds, tokens, (seconds,) * len(prompts), same_texts=same))

  log(f"server: {len(prompts)} requests, {options.clients} clients")
  served, served_texts = _serve(model, tokenizer, method, options, prompts)
  rows.append(dataclasses.replace(served, same_texts=sum(a == b for a, b in zip(served_texts, texts))))
  return rows
