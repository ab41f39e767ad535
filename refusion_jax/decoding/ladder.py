"""A ladder of prompt buckets: one `Engine` per bucket, sharing the placed weights, each prompt paying for its length.

Every forward of a decode loop attends over its rows' whole cache, prompt
bucket P + answer G, so one engine compiled for long prompts makes every
request pay for them. An `EngineLadder` keeps one engine per bucket (each its
own compiled loop, rows and KV cache) over one placement of the weights and,
where it is on, one prefix cache: a request goes to the smallest bucket that
holds its prompt, and each `advance` runs one loop call of the next engine
with work, in turn. Nothing compiles after each engine's first call
(docs/serving.md, "Prompt buckets").
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import Any

from refusion_jax.decoding.contract import Decoder, Method
from refusion_jax.decoding.engine import Engine
from refusion_jax.decoding.options import DecodeOptions
from refusion_jax.decoding.prefix_cache import PrefixCache
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer, inference_view

# The default ladder: buckets from SMALLEST_BUCKET up, each LADDER_STEP times the last, the last the longest prompt
# (so a prompt pays for at most LADDER_STEP times its length, and a ladder to 32,768 tokens compiles 7 loops).
SMALLEST_BUCKET, LADDER_STEP = 64, 4
# Buckets up to this many prompt tokens get all K rows by default; a longer bucket gets the rows that K rows of
# this bucket's cache hold, at least one, so no bucket's cache exceeds K × (FULL_ROWS_UP_TO + G) tokens.
FULL_ROWS_UP_TO = 1024


def default_buckets(max_prompt_tokens: int) -> tuple[int, ...]:
  """SMALLEST_BUCKET, × LADDER_STEP ..., below `max_prompt_tokens`, then it."""
  top = max_prompt_tokens
  buckets, bucket = [], SMALLEST_BUCKET
  while bucket < top:
    buckets.append(bucket)
    bucket *= LADDER_STEP
  return (*buckets, top)


def default_bucket_rows(buckets: Sequence[int], rows: int, gen_length: int) -> tuple[int, ...]:
  """K = `rows` rows for buckets up to FULL_ROWS_UP_TO, fewer above: as many as K × (FULL_ROWS_UP_TO + G) cache
  tokens hold, at least 1."""
  budget = rows * (FULL_ROWS_UP_TO + gen_length)
  return tuple(max(1, min(rows, budget // (bucket + gen_length))) for bucket in buckets)


def check_ladder(buckets: Sequence[int], bucket_rows: Sequence[int]) -> None:
  """Buckets strictly increasing and positive, one positive row count each."""
  if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
    raise ValueError(f"Prompt buckets {list(buckets)} must be positive and strictly increasing, e.g. 64,256,1024.")
  if len(bucket_rows) != len(buckets) or any(r < 1 for r in bucket_rows):
    raise ValueError(
      f"Give one positive row count per prompt bucket: {len(buckets)} buckets {list(buckets)}, rows "
      f"{list(bucket_rows)}."
    )


class EngineLadder:
  """Engines for a ladder of prompt buckets over one placement of the weights, driven as one engine.

      ladder = EngineLadder(model, rj.ReFusion(gen_length=64), rj.DecodeOptions(rows=8), buckets=(64, 256, 1024))
      request = ladder.submit(prompt_ids)          # to the smallest bucket that holds it
      while not ladder.idle:
        finished = ladder.advance(iterations=8)    # one loop call of the next engine with work
        ladder.partial(request)

  Attributes:
    engines: one per bucket, smallest first (`Engine.prompt_width` its bucket, `Engine.rows` its rows).
    prefix_cache: the `PrefixCache` every engine shares (None: off; `DecodeOptions.prefix_cache_tokens`).
    rows: the rows of all engines together.
    prompt_width: the longest prompt taken (`max_prompt_tokens`, else the largest bucket).
  """

  def __init__(
    self,
    model: Transformer,
    method: Method,
    options: DecodeOptions,
    *,
    buckets: Sequence[int],
    bucket_rows: Sequence[int] | None = None,
    sampling: bool = False,
    max_prompt_tokens: int | None = None,
  ):
    """
    Args:
      options: how every engine decodes (`DecodeOptions`); its `rows`, K, is the default rows of each bucket
        (`default_bucket_rows`) and its `prefix_cache_tokens` the size of the one shared prefix cache.
      buckets: the prompt buckets, increasing.
      bucket_rows: the rows of each bucket (None: `default_bucket_rows`).
      sampling: as `Engine`'s: requests may bring their own temperatures.
      max_prompt_tokens: the longest prompt taken (None: the largest bucket), at most the largest bucket.
    """
    if options.rows is None and bucket_rows is None:
      raise ValueError("A ladder needs its rows: give DecodeOptions(rows=K) or bucket_rows=(...) per bucket.")
    bucket_rows = default_bucket_rows(buckets, options.rows, method.gen_length) if bucket_rows is None else bucket_rows
    check_ladder(buckets, bucket_rows)
    if max_prompt_tokens is not None and not 0 < max_prompt_tokens <= buckets[-1]:
      raise ValueError(
        f"max_prompt_tokens={max_prompt_tokens} must be positive and fit the largest bucket, {buckets[-1]}."
      )
    self.prompt_width = buckets[-1] if max_prompt_tokens is None else max_prompt_tokens
    model = inference_view(model)  # cast once for every bucket (a view of a view is itself)
    self.engines: list[Engine] = []
    self.prefix_cache: PrefixCache | None = None
    for bucket, rows in zip(buckets, bucket_rows):
      engine = Engine(
        model,
        method,
        dataclasses.replace(options, rows=rows),
        prompt_width=bucket,
        sampling=sampling,
        weights_from=self.engines[0] if self.engines else None,
        prefix_cache=self.prefix_cache,
      )
      self.prefix_cache = engine.prefix_cache
      self.engines.append(engine)
    self._turn = 0  # the engine whose turn it is to run first
    self._next_request = 0
    self._requests: dict[int, tuple[Engine, int]] = {}  # the ladder's request -> its engine and number there
    self._numbers: dict[tuple[int, int], int] = {}  # (engine's index, its number) -> the ladder's request

  @property
  def buckets(self) -> tuple[int, ...]:
    return tuple(engine.prompt_width for engine in self.engines)

  @property
  def bucket_rows(self) -> tuple[int, ...]:
    return tuple(engine.rows for engine in self.engines)

  @property
  def rows(self) -> int:
    return sum(self.bucket_rows)

  @property
  def decoder(self) -> Decoder:
    """The method split as every engine runs it."""
    return self.engines[0].decoder

  @property
  def config(self) -> ModelConfig:
    return self.engines[0].config

  @property
  def idle(self) -> bool:
    return all(engine.idle for engine in self.engines)

  @property
  def cache_bytes(self) -> int:
    """Bytes of every engine's decode state (their rows' KV caches, mostly), the prefix cache's pool apart."""
    return sum(engine.state_bytes for engine in self.engines)

  @property
  def loop_calls(self) -> int:
    return sum(engine.loop_calls for engine in self.engines)

  def compile(self, iterations: int | None = None) -> None:
    """Compile every bucket's loop for `advance(iterations)` calls now, on threads at once (XLA compiles
    outside Python's lock), so that no call compiles later (`Engine.compile`)."""
    with concurrent.futures.ThreadPoolExecutor(len(self.engines)) as pool:
      for done in [pool.submit(engine.compile, iterations) for engine in self.engines]:
        done.result()

  def engine_for(self, length: int) -> Engine:
    """The engine of the smallest bucket that holds a prompt of `length` tokens."""
    for engine in self.engines:
      if length <= min(engine.prompt_width, self.prompt_width):
        return engine
    raise ValueError(
      f"A prompt of {length} tokens is longer than the longest this ladder takes, {self.prompt_width} tokens; "
      "shorten it or serve longer prompts (--max_prompt_tokens)."
    )

  def submit(self, prompt_ids: Sequence[int], **sampling: Any) -> int:
    """Queue a prompt in the smallest bucket that holds it (`Engine.submit`: its keywords too); returns the
    ladder's request number. A request without a seed draws the noise of its number in its bucket's engine."""
    engine = self.engine_for(len(prompt_ids))
    number = engine.submit(prompt_ids, **sampling)
    request = self._next_request
    self._next_request += 1
    self._requests[request] = (engine, number)
    self._numbers[self.engines.index(engine), number] = request
    return request

  def advance(self, iterations: int | None = None) -> list[int]:
    """One loop call of the next engine with work (in turn, so every bucket advances); the requests that
    finished in it."""
    count = len(self.engines)
    for step in range(count):
      index = (self._turn + step) % count
      if not self.engines[index].idle:
        self._turn = (index + 1) % count
        return [self._numbers[index, number] for number in self.engines[index].advance(iterations)]
    return []

  def _find(self, request: int) -> tuple[Engine, int]:
    if request not in self._requests:
      raise ValueError(
        f"Request {request} is neither decoding nor finished, nor queued (cancelled or never submitted)."
      )
    return self._requests[request]

  def partial(self, request: int) -> list[int]:
    """`Engine.partial` of the request, in its bucket's engine."""
    engine, number = self._find(request)
    return engine.partial(number)

  def partial_logprobs(self, request: int) -> list[float]:
    """`Engine.partial_logprobs` of the request, in its bucket's engine."""
    engine, number = self._find(request)
    return engine.partial_logprobs(number)

  def reused_tokens(self, request: int) -> int:
    """`Engine.reused_tokens` of the request: its prompt tokens taken from the prefix cache."""
    engine, number = self._find(request)
    return engine.reused_tokens(number)

  def forwards(self, request: int) -> int:
    """`Engine.forwards` of the request, in its bucket's engine."""
    engine, number = self._find(request)
    return engine.forwards(number)

  def cancel(self, request: int) -> None:
    """Drop the request, queued, decoding or finished (`Engine.cancel`); the ladder forgets it."""
    if request not in self._requests:
      return
    engine, number = self._requests.pop(request)
    del self._numbers[self.engines.index(engine), number]
    engine.cancel(number)
