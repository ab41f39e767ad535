"""The decode benchmark: ReFusion against its eager reference and the AR / MDM baselines, at batch 1 and a batch.

For every model, in one run: the jitted ReFusion decoder and the eager
reference at batch 1 (same tokens, speed ratio), ReFusion vs AR vs MDM
(forwards per row, tokens per forward, tokens/s) at batch 1 and at the batch,
and the KV-cache bytes of the cached decoders. At each batch the methods are
timed by `benchmarks.timer`: a warm-up call each (timed apart: "compile" =
warm-up − median run), then `repeats` interleaved rounds, their median and
spread reported. `format_table` and `summary` write the report.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from refusion_jax.benchmarks.models import BenchModel, TrainedSource, random_bench_model, trained_bench_model
from refusion_jax.benchmarks.table import byte_count, spread, table
from refusion_jax.benchmarks.timer import Timing, log, time_rounds
from refusion_jax.decoding.ar import AR
from refusion_jax.decoding.engine import decode
from refusion_jax.decoding.mdm import MDM
from refusion_jax.decoding.prompts import bucket_length
from refusion_jax.decoding.reference import decode_reference
from refusion_jax.decoding.refusion import ReFusion
from refusion_jax.decoding.result import DecodeResult
from refusion_jax.model import config as config_lib
from refusion_jax.model.cache import kv_cache_bytes

EAGER = "refusion eager ref."  # the eager reference's method name: batch 1 only


@dataclasses.dataclass(frozen=True)
class DecodeBenchOptions:
  """What the decode benchmark runs: the method values, the batch, the timing and the random models."""

  refusion: ReFusion
  batch: int = 16  # the large batch (batch 1 is always measured too)
  repeats: int = 3  # timed rounds after the warm-up (benchmarks.timer); the median is reported
  mdm: MDM | None = None  # None: MDM's defaults for ReFusion's gen_length
  sizes: Sequence[str] = ("tiny", "small")  # random models' presets (without a trained source)
  sharpen: float = 128.0  # LM-head scale of the random models (1: plain init)
  seed: int = 0  # weights and prompts of the random models

  @property
  def methods(self) -> dict[str, ReFusion | AR | MDM]:
    """The method value of each jitted method, all with ReFusion's answer length."""
    gen_length = self.refusion.gen_length
    return dict(refusion=self.refusion, ar=AR(gen_length), mdm=self.mdm or MDM(gen_length))

  def check(self) -> None:
    """Reject bad options before anything is built or compiled (the method values checked themselves)."""
    if self.batch < 1 or self.repeats < 1:
      raise ValueError(f"--batch ({self.batch}) and --repeats ({self.repeats}) must be at least 1.")
    self.methods  # noqa: B018  (builds the default MDM value, which checks itself)
    unknown = [s for s in self.sizes if s not in config_lib.PRESETS]
    if unknown:
      raise ValueError(f"Unknown --random_init {unknown}; choose among {sorted(config_lib.PRESETS)}.")


@dataclasses.dataclass
class Measurement:
  """One (model, method, batch) cell of the table."""

  model: str
  method: str
  batch: int
  forwards: float  # mean forwards per row
  tpf: float  # all answer tokens ÷ all forwards
  tokens_per_s: float  # answer tokens of the batch ÷ median run time
  timing: Timing  # the warm-up and the timed rounds
  host_ms: float | None  # host milliseconds per loop call (`DecodeResult.host_seconds`); None: no loop
  kv_cache_bytes: int | None  # None: the method keeps no cache
  tokens: list[list[int]]

  @property
  def run_s(self) -> float:
    """The median run."""
    return self.timing.median


def decoders(bench: BenchModel, options: DecodeBenchOptions) -> dict[str, Callable[[list[list[int]]], DecodeResult]]:
  """Each method as a function of the prompts, with the run's method values and special ids bound."""
  ids = dict(mask_id=bench.mask_id, eos_id=bench.eos_id, pad_id=bench.pad_id)
  calls = {
    name: functools.partial(decode, bench.model, method=method, **ids) for name, method in options.methods.items()
  }
  fields = options.refusion.reference_fields
  eager = lambda p: decode_reference(bench.model, p[0], **fields, mask_id=bench.mask_id, eos_id=bench.eos_id)
  return {"refusion": calls["refusion"], EAGER: eager, "ar": calls["ar"], "mdm": calls["mdm"]}


def bench_decode(bench: BenchModel, options: DecodeBenchOptions) -> list[Measurement]:
  """Every method at batch 1 and at the full batch of `bench.prompts` (the eager reference at batch 1 only)."""
  capacity = bucket_length(max(len(p) for p in bench.prompts)) + options.refusion.gen_length
  # The eager reference keeps growing host arrays rather than a fixed-capacity cache.
  cached = {"refusion", "ar"}
  rows = []
  for batch in sorted({1, len(bench.prompts)}):
    prompts = bench.prompts[:batch]
    calls = {
      method: functools.partial(call, prompts)
      for method, call in decoders(bench, options).items()
      if method != EAGER or batch == 1
    }
    log(f"{bench.name}, batch {batch}: {', '.join(calls)}")
    results, timings = time_rounds(calls, options.repeats)
    for method, result in results.items():
      timing = timings[method]
      rows.append(
        Measurement(
          model=bench.name,
          method=method,
          batch=batch,
          forwards=float(np.mean(result.num_forwards)),
          tpf=result.overall_tpf,
          tokens_per_s=sum(len(t) for t in result.tokens) / timing.median,
          timing=timing,
          host_ms=1e3 * result.host_seconds / result.loop_calls if result.loop_calls else None,
          kv_cache_bytes=kv_cache_bytes(bench.model.config, batch, capacity) if method in cached else None,
          tokens=result.tokens,
        )
      )
  return rows


def run_decode_bench(options: DecodeBenchOptions, trained: TrainedSource | None = None) -> list[Measurement]:
  """The decode benchmark on the trained model, or else on each random model of `options.sizes`."""
  options.check()
  if trained:
    builds = [lambda: trained_bench_model(trained, options.batch, options.seed)]
  else:
    builds = [
      lambda size=size: random_bench_model(size, options.batch, options.sharpen, options.seed) for size in options.sizes
    ]
  rows = []
  for build in builds:
    bench = build()
    log(
      f"{bench.name}: {sum(x.size for x in jax.tree.leaves(nnx.state(bench.model))):,} parameters, "
      f"{len(bench.prompts)} prompts of {min(map(len, bench.prompts))}-{max(map(len, bench.prompts))} tokens"
    )
    rows += bench_decode(bench, options)
  return rows


def format_table(rows: Sequence[Measurement]) -> str:
  """The decode benchmark as a table under the machine's name, one line per measurement."""
  header = ("model", "method", "batch", "fwd/row", "TPF", "tokens/s", "compile s", "run s", "spread", "host ms/call")
  header += ("KV cache",)
  lines = [
    (
      r.model,
      r.method,
      str(r.batch),
      f"{r.forwards:.1f}",
      f"{r.tpf:.2f}",
      f"{r.tokens_per_s:.1f}",
      f"{r.timing.compile_seconds:.2f}",
      f"{r.run_s:.3f}",
      spread(r.timing),
      "-" if r.host_ms is None else f"{r.host_ms:.2f}",
      byte_count(r.kv_cache_bytes),
    )
    for r in rows
  ]
  return table(header, lines)


def summary(rows: Sequence[Measurement]) -> str:
  """Per model: jitted vs eager speed (same-round ratio) and agreement, and the batching speed-up of each method."""
  out = []
  for name in dict.fromkeys(r.model for r in rows):
    cell = {(r.method, r.batch): r for r in rows if r.model == name}
    jitted, eager = cell[("refusion", 1)], cell[(EAGER, 1)]
    same = "same tokens" if jitted.tokens == eager.tokens else "DIFFERENT tokens"
    speed = eager.timing.ratio_to(jitted.timing)
    out.append(f"{name}: jitted ReFusion is {speed:.1f}x the eager reference at batch 1 ({same}).")
    batch = max(b for _, b in cell)
    if batch > 1:
      gains = ", ".join(
        f"{m} {cell[(m, batch)].tokens_per_s / cell[(m, 1)].tokens_per_s:.1f}x" for m in ("refusion", "ar", "mdm")
      )
      out.append(f"{name}: tokens/s at batch {batch} over batch 1: {gains}.")
  return "\n".join(out)
