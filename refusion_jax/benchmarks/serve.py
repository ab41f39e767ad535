"""What `python -m refusion_jax.bench serve` runs: the OpenAI server under N concurrent streaming clients, against
the same prompts through the `Sampler` one by one (and with K rows), in one run, over a few workloads.

The servers run in this process (uvicorn on threads, the model loaded once),
on 127.0.0.1 with free ports; the clients are asyncio tasks over HTTP, at
most `clients` in flight, each asking one prompt (as token ids) greedily
(temperature 0), so every mode's answers can be compared with the one-by-one
Sampler's. The workloads (`WORKLOADS`):

* `short`: prompts of 1 to 12 random words; the server with one bucket of
  `max_prompt_tokens` and the Sampler with K rows beside the one by one;
* `shared_prefix`: a system prompt of `system_tokens` tokens followed by a
  short distinct question in every request; the server with and without its
  prefix cache (docs/serving.md, "The prefix cache");
* `mixed`: prompt lengths spread log-uniformly up to `longest_prompt`; the
  server with its default ladder of buckets up to it, with and without the
  prefix cache (docs/serving.md, "Prompt buckets");
* `probe`: `probes` prompts of 16 tokens one at a time, on the server whose
  ladder reaches `longest_prompt` against the one whose ladder stops at
  `max_prompt_tokens`: what a short prompt pays for the long ones served.

Per mode: requests/s, answer tokens/s, p50/p99 latency (arrival to last byte)
and, for a server, p50/p99 time to the first streamed text. The modes of a
workload are timed by `benchmarks.timer`: a warm-up pass each (what it
compiles; a server's prefix cache then holds the warm-up's prompts, as a
serving one holds its system prompts), then `repeats` interleaved rounds
over all the prompts; rates are of the median round, the latencies of the last.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import httpx
import numpy as np

from refusion_jax.benchmarks.models import sharpen
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
WORKLOADS = ("short", "shared_prefix", "mixed", "probe")


@dataclasses.dataclass(frozen=True)
class ServeBenchOptions:
  """The load: N prompts from C clients at most in flight, K rows per bucket, the workloads to run (comma-separated
  names of `WORKLOADS`) and their sizes."""

  prompts: int = 64
  clients: int = 16
  rows: int = 8
  max_prompt_tokens: int = 64  # the short workload's server, and the probe's small ladder
  chunk_iterations: int = 8
  seed: int = 0
  repeats: int = 1  # timed rounds after the warm-up (benchmarks.timer)
  workloads: str = "short"
  system_tokens: int = 512  # shared_prefix: the system prompt every request begins with
  longest_prompt: int = 2048  # mixed and probe: the longest prompt, the top of the large server's ladder
  probes: int = 16  # probe: 16-token prompts sent one at a time
  prefix_cache_tokens: int = 8192  # the servers' prefix cache, where it is on
  sharpen: float = 1.0  # LM-head scale of a random model (`benchmarks.models.sharpen`); 1: as initialised

  def __post_init__(self) -> None:
    unknown = sorted(set(self.names) - set(WORKLOADS))
    if unknown:
      raise ValueError(f"Unknown workloads {unknown}; choose among {', '.join(WORKLOADS)} (comma-separated).")

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(name for name in self.workloads.split(",") if name)


@dataclasses.dataclass(frozen=True)
class ServeBenchRow:
  """One mode's measurement on one workload (latencies in seconds, of the last round; time to first text only where
  a mode streams)."""

  mode: str
  timing: Timing  # of a pass over all the prompts
  answer_tokens: int
  latencies: tuple[float, ...]
  first_text: tuple[float, ...] = ()
  same_texts: int = 0
  workload: str = "short"

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


def _word_ids(tokenizer: Tokenizer, rng: np.random.Generator, length: int) -> list[int]:
  """Exactly `length` token ids of random words."""
  ids: list[int] = []
  while len(ids) < length:
    ids += tokenizer.encode(" ".join(rng.choice(WORDS, size=max(4, length - len(ids)))) + " ")
  return ids[:length]


def workload_prompts(name: str, tokenizer: Tokenizer, options: ServeBenchOptions) -> list[list[int]]:
  """The prompts (token ids) of workload `name`."""
  rng = np.random.default_rng(options.seed)
  count = options.prompts
  if name == "short":
    return [tokenizer.encode(text) for text in bench_prompts(count, options.seed)]
  if name == "shared_prefix":
    system = _word_ids(tokenizer, rng, options.system_tokens)
    return [system + _word_ids(tokenizer, rng, int(rng.integers(8, 25))) for _ in range(count)]
  if name == "mixed":
    lengths = np.exp(rng.uniform(np.log(8), np.log(options.longest_prompt), count)).astype(int)
    return [_word_ids(tokenizer, rng, int(n)) for n in lengths]
  return [_word_ids(tokenizer, rng, 16) for _ in range(options.probes)]


def _free_port() -> int:
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    return probe.getsockname()[1]


async def _ask(
  http: httpx.AsyncClient, gate: asyncio.Semaphore, prompt: list[int], model: str
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
        text = chunk["choices"][0]["text"] if chunk["choices"] else ""
        if text and first is None:
          first = time.perf_counter() - start
        texts.append(text)
        tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    latency = time.perf_counter() - start
    return "".join(texts), tokens, latency, latency if first is None else first


# A pass over the prompts: (texts, answer tokens, latencies, times to first text: empty where a mode streams none).
Pass = tuple[list[str], int, tuple[float, ...], tuple[float, ...]]


@dataclasses.dataclass(frozen=True)
class _ServerKind:
  """A server of the run: its longest prompt (its default ladder up to it) and whether it keeps a prefix cache."""

  max_prompt_tokens: int
  prefix_cache: bool

  def mode(self, clients: int, rows: int) -> str:
    cache = "prefix cache" if self.prefix_cache else "no prefix cache"
    return f"server to {self.max_prompt_tokens}, {cache}, {clients} clients, K={rows}"


@contextlib.contextmanager
def _running_server(
  model: Transformer, tokenizer: Tokenizer, method: Method, options: ServeBenchOptions, kind: _ServerKind
) -> Iterator[int]:
  """A server on a thread of this process while the block runs; yields its port."""
  port = _free_port()
  decode = DecodeOptions(
    rows=options.rows,
    chunk_iterations=options.chunk_iterations,
    prefix_cache_tokens=options.prefix_cache_tokens if kind.prefix_cache else 0,
  )
  server_options = ServerOptions(
    method=method,
    decode=decode,
    max_prompt_tokens=kind.max_prompt_tokens,
    max_queue=max(options.prompts, options.probes),
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


def _served(port: int, prompts: Sequence[list[int]], clients: int) -> Pass:
  """Every prompt as a streamed request, at most `clients` in flight."""

  async def load() -> list:
    gate = asyncio.Semaphore(clients)
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits) as http:
      return await asyncio.gather(*(_ask(http, gate, p, "bench") for p in prompts))

  texts, tokens, latencies, first = zip(*asyncio.run(load()))
  return list(texts), sum(tokens), latencies, first


def _one_by_one(sampler: Sampler, prompts: Sequence[list[int]]) -> Pass:
  texts, tokens, latencies = [], 0, []
  for prompt in prompts:
    begin = time.perf_counter()
    result = sampler.decode_ids([prompt])
    latencies.append(time.perf_counter() - begin)
    texts.append(sampler.tokenizer.decode(result.tokens[0]))
    tokens += len(result.tokens[0])
  return texts, tokens, tuple(latencies), ()


def _batched(sampler: Sampler, prompts: Sequence[list[int]]) -> Pass:
  begin = time.perf_counter()
  result = sampler.decode_ids(prompts)
  seconds = time.perf_counter() - begin
  texts = [sampler.tokenizer.decode(tokens) for tokens in result.tokens]
  return texts, sum(len(t) for t in result.tokens), (seconds,) * len(prompts), ()


def run_serve_bench(
  model: Transformer, tokenizer: Tokenizer, method: Method, options: ServeBenchOptions
) -> list[ServeBenchRow]:
  """Each workload's modes over its prompts, each after a warm-up pass that compiles what it runs (the module's
  docstring says which modes a workload has); the first mode of a workload is the Sampler one by one (prompts
  padded to their own buckets), which the others' texts are compared with. With `options.sharpen`, `model`'s LM
  head is sharpened in place first (random weights only)."""
  if options.sharpen != 1.0:  # confident random weights: slots pass as a trained model's do, EOS never comes
    model = sharpen(model, options.sharpen, never=tokenizer.eos_id)
  one = Sampler(model, tokenizer, method, seed=options.seed)
  batched = Sampler(model, tokenizer, method, rows=options.rows, seed=options.seed)
  small, large = options.max_prompt_tokens, options.longest_prompt
  rows: list[ServeBenchRow] = []
  with contextlib.ExitStack() as stack:
    ports: dict[_ServerKind, int] = {}

    def served(kind: _ServerKind, prompts: list[list[int]], clients: int) -> tuple[str, Callable[[], Pass]]:
      if kind not in ports:
        log(f"starting the server to {kind.max_prompt_tokens} tokens, prefix cache {kind.prefix_cache}")
        ports[kind] = stack.enter_context(_running_server(model, tokenizer, method, options, kind))
      return kind.mode(clients, options.rows), lambda: _served(ports[kind], prompts, clients)

    for name in options.names:
      prompts = workload_prompts(name, tokenizer, options)
      log(f"{name}: {len(prompts)} prompts of {min(map(len, prompts))} to {max(map(len, prompts))} tokens")
      calls: dict[str, Callable[[], Pass]] = {"sampler one by one": lambda p=prompts: _one_by_one(one, p)}
      if name == "short":
        calls[f"sampler, K={options.rows}"] = lambda p=prompts: _batched(batched, p)
        kinds = [(_ServerKind(small, True), options.clients)]
      elif name == "probe":
        kinds = [(_ServerKind(small, True), 1), (_ServerKind(large, True), 1)]
      else:
        kinds = [(_ServerKind(large, True), options.clients), (_ServerKind(large, False), options.clients)]
      for kind, clients in kinds:
        mode, call = served(kind, prompts, clients)
        calls[mode] = call
      passes, timings = time_rounds(calls, options.repeats)
      reference = passes["sampler one by one"][0]
      for mode, (texts, tokens, latencies, first) in passes.items():
        same = sum(a == b for a, b in zip(texts, reference))
        rows.append(ServeBenchRow(mode, timings[mode], tokens, latencies, first, same_texts=same, workload=name))
  return rows


def format_serve(rows: Sequence[ServeBenchRow]) -> str:
  """A table per workload: each mode's rates and latency percentiles, its requests/s over the first mode's (one by
  one), and how its texts compare; for the prefix cache and the probe, the ratios they are run for."""
  out = []
  for workload in dict.fromkeys(r.workload for r in rows):
    out += [f"workload: {workload}", _workload_table([r for r in rows if r.workload == workload]), ""]
  return "\n".join(out).rstrip()


def _workload_table(rows: Sequence[ServeBenchRow]) -> str:
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
  notes = [f"requests/s over {base.mode}: {ratios}.", f"texts equal to {base.mode}'s: {same}."]
  with_cache = [r for r in rows if ", prefix cache," in r.mode]
  without = [r for r in rows if "no prefix cache" in r.mode]
  if with_cache and without:
    on, off = with_cache[0], without[0]
    first = np.median(off.first_text) / np.median(on.first_text)
    notes.append(
      f"prefix cache on over off: requests/s {off.timing.ratio_to(on.timing):.2f}x, p50 time to first text "
      f"{first:.2f}x shorter."
    )
  servers = [r for r in rows if r.mode.startswith("server")]
  if len(servers) == 2 and not without:  # the probe: one short prompt at a time, a long ladder over a short one
    short_ladder, long_ladder = servers
    ratio = np.median(long_ladder.latencies) / np.median(short_ladder.latencies)
    notes.append(f"p50 latency of a 16-token prompt, {long_ladder.mode} / {short_ladder.mode}: {ratio:.2f}x.")
  return "\n".join([table(header, lines), "", *notes])
