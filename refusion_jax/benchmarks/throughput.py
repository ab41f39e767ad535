"""The throughput benchmark: many prompts one by one, in static batches and by continuous batching.

It decodes N prompts (several N in one run) with ReFusion: each prompt alone
(B = 1, sequential), the same with every forward a whole block wide (the
decoder before forwards were fitted to their work), static batches of K, and
K rows kept busy by continuous batching, with the forwards per answer,
batched forwards (loop iterations), their average width, tokens/s and (in
`format_throughput`) the ratio to the sequential run. Continuous K = 1 runs the
whole queue through one compiled call on a single row: what it gains over the
sequential run is the per-call host work (splitting the model, starting the
batch, reading back), and what K > 1 gains over it is the rows sharing
forwards. Modes are timed by `benchmarks.timer` (a warm-up call each, then
interleaved rounds); every mode must give the same tokens. With `official_repo` (a
checkout of ML-GSAI/ReFusion) it also times the official `generate.py` at
B = 1 on the smallest N, on the same weights (`benchmarks.official`; torch is
imported only then), on our accelerator when torch reaches it (else the CPU)
and in the model's dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from refusion_jax.benchmarks.models import BenchModel, TrainedSource, random_bench_model, trained_bench_model
from refusion_jax.benchmarks.table import spread, table
from refusion_jax.benchmarks.timer import Timing, log, time_rounds
from refusion_jax.decoding.engine import decode
from refusion_jax.decoding.refusion import ReFusion
from refusion_jax.decoding.result import DecodeResult

# Random prompts of 20-27 tokens: one length bucket, so every prompt count runs on the programs the warm-up
# compiled, and long enough that the prefill is a real share of the work, as with a task's query.
PROMPT_LENGTHS = (20, 27)
# The label of the official PyTorch decoder's mode (B = 1, prompt by prompt; the label adds the torch device and
# the dtype); timed on the smallest prompt count only.
OFFICIAL = "official PyTorch"


@dataclasses.dataclass(frozen=True)
class ThroughputOptions:
  """What the throughput benchmark runs: the decoding knobs, the prompt counts, the modes' K and the model."""

  refusion: ReFusion
  prompts: Sequence[int] = (8, 64)  # prompt counts N
  batch_sizes: Sequence[int] = (1, 8, 16)  # K of the batched modes
  repeats: int = 3  # timed rounds after the warm-up (benchmarks.timer); medians
  size: str = "tiny"  # random model preset
  num_layers: int | None = 3  # random model: its layers (None: the preset's)
  dtype: str | None = None  # random model: activation and parameter dtype (None: the preset's)
  sharpen: float = 64.0  # LM-head scale of the random model
  seed: int = 0
  official_repo: str | None = None  # a checkout of ML-GSAI/ReFusion: also time its generate.py

  def check(self) -> None:
    if self.repeats < 1 or min(self.prompts) < 1 or min(self.batch_sizes) < 1:
      raise ValueError("--repeats, --prompts and --batch_sizes must be at least 1.")


@dataclasses.dataclass(frozen=True)
class Mode:
  """One way of decoding the prompts: its label, its rows decoding at once and the decode calls it makes."""

  label: str
  rows: int  # K (1: one by one); a batch of N < K prompts uses N rows
  decode: Callable[[list[list[int]]], list[DecodeResult]]
  official: bool = False  # the official PyTorch decoder (timed on the smallest prompt count only)


@dataclasses.dataclass
class ThroughputRow:
  """One (prompt count, mode) line of the throughput table; counts summed over the mode's decode calls."""

  prompts: int
  mode: str
  rows: int  # K: rows decoding at once
  forwards_per_answer: float  # mean forwards a prompt took part in (prefill included)
  batch_forwards: int  # loop iterations: batched forwards, prefills not included
  average_width: float  # mean query width (tokens per row) of those forwards
  tokens_per_s: float
  timing: Timing  # the warm-up and the timed rounds
  widths: dict[str, dict[int, int]]
  tokens: list[list[int]]
  official: bool = False  # the official PyTorch decoder's row

  @property
  def run_s(self) -> float:
    """The median round."""
    return self.timing.median


def throughput_modes(bench: BenchModel, options: ThroughputOptions) -> list[Mode]:
  """Each mode: one call per prompt, per static batch, or one continuous call (and the official decoder)."""
  ids = dict(mask_id=bench.mask_id, eos_id=bench.eos_id, pad_id=bench.pad_id)
  method, full_width = options.refusion, dataclasses.replace(options.refusion, fit_width=False)
  run = lambda prompts, method=method, **more: decode(bench.model, prompts, method, **ids, **more)
  modes = [
    Mode("sequential", 1, lambda ps: [run([p]) for p in ps]),
    Mode("sequential, full width", 1, lambda ps: [run([p], full_width) for p in ps]),
  ]
  for k in options.batch_sizes:
    if k > 1:  # static batches of 1 are the sequential mode
      modes.append(Mode(f"static {k}", k, lambda ps, k=k: [run(ps[i : i + k]) for i in range(0, len(ps), k)]))
  for k in options.batch_sizes:
    modes.append(Mode(f"continuous {k}", k, lambda ps, k=k: [run(ps, batch_size=k)]))
  if options.official_repo:
    from refusion_jax.benchmarks.official import OfficialDecoder  # imports torch: only when asked for

    official = OfficialDecoder(bench.model, options.official_repo)
    label = f"{OFFICIAL} {official.device.type} {bench.model.config.dtype}"
    fields = method.reference_fields
    del fields["temperature"]  # the official decoder is greedy
    decode_official = lambda ps: [official.decode(ps, **fields, mask_id=bench.mask_id, eos_id=bench.eos_id)]
    modes.append(Mode(label, 1, decode_official, official=True))
  return modes


def _merge_widths(results: Sequence[DecodeResult]) -> dict[str, dict[int, int]]:
  merged: dict[str, dict[int, int]] = {}
  for result in results:
    for name, counts in result.widths.items():
      for width, count in counts.items():
        merged.setdefault(name, {})[width] = merged.get(name, {}).get(width, 0) + count
  return merged


def bench_throughput(bench: BenchModel, options: ThroughputOptions) -> list[ThroughputRow]:
  """Every mode on the first N prompts for each N of `options.prompts`, timed in interleaved rounds."""
  smallest = min(options.prompts)
  cells = {
    f"{n} prompts, {mode.label}": (n, mode)
    for n in options.prompts
    for mode in throughput_modes(bench, options)
    if not mode.official or n == smallest
  }
  calls = {label: (lambda n=n, mode=mode: mode.decode(bench.prompts[:n])) for label, (n, mode) in cells.items()}
  results, timings = time_rounds(calls, options.repeats)
  rows = []
  for label, (n, mode) in cells.items():
    decoded, timing = results[label], timings[label]
    widths = _merge_widths(decoded)
    forward = widths.get("forward", {})
    tokens = [t for r in decoded for t in r.tokens]
    rows.append(
      ThroughputRow(
        prompts=n,
        mode=mode.label,
        rows=min(mode.rows, n),
        forwards_per_answer=float(np.mean(np.concatenate([r.num_forwards for r in decoded]))),
        batch_forwards=sum(forward.values()),
        average_width=sum(w * c for w, c in forward.items()) / max(sum(forward.values()), 1),
        tokens_per_s=sum(map(len, tokens)) / timing.median,
        timing=timing,
        widths=widths,
        tokens=tokens,
        official=mode.official,
      )
    )
  return rows


def run_throughput_bench(options: ThroughputOptions, trained: TrainedSource | None = None) -> list[ThroughputRow]:
  """The throughput benchmark on the trained model, or else on a random model of `options.size`."""
  options.check()
  count = max(options.prompts)
  if trained:
    bench = trained_bench_model(trained, count, options.seed)
  else:
    overrides = dict(num_layers=options.num_layers) if options.num_layers else {}
    if options.dtype:
      overrides.update(dtype=options.dtype, param_dtype=options.dtype)
    bench = random_bench_model(options.size, count, options.sharpen, options.seed, PROMPT_LENGTHS, **overrides)
  log(f"{bench.name}: {len(bench.prompts)} prompts of {min(map(len, bench.prompts))}-{max(map(len, bench.prompts))}")
  return bench_throughput(bench, options)


def format_throughput(rows: Sequence[ThroughputRow]) -> str:
  """The throughput table, the same-tokens check, and the per-stage width histograms of the largest prompt count."""
  sequential = {r.prompts: r for r in rows if r.mode == "sequential"}
  header = ("prompts", "mode", "K", "fwd/answer", "batch fwds", "avg width", "tokens/s", "run s", "spread")
  header += ("vs sequential",)
  lines = [
    (
      str(r.prompts),
      r.mode,
      str(r.rows),
      f"{r.forwards_per_answer:.1f}",
      str(r.batch_forwards),
      f"{r.average_width:.1f}",
      f"{r.tokens_per_s:.0f}",
      f"{r.run_s:.3f}",
      spread(r.timing),
      f"{sequential[r.prompts].timing.ratio_to(r.timing):.2f}x",
    )
    for r in rows
  ]
  out = [table(header, lines), ""]
  different = [f"{r.prompts} prompts {r.mode}" for r in different_from_sequential(rows)]
  out.append(f"DIFFERENT tokens from sequential: {different}" if different else "every mode: the same tokens.")
  for r in rows:
    if r.official:
      reference = sequential[r.prompts]
      out.append(
        f"{r.prompts} prompts at B = 1: the jitted decoder is {r.timing.ratio_to(reference.timing):.1f}x faster "
        f"than the official code ({r.mode}); {same_answers(r, reference)} of {r.prompts} answers identical."
      )
  largest = max(sequential)
  for r in rows:
    if r.prompts == largest and (r.mode == "sequential" or (r.mode.startswith("continuous") and r.rows > 1)):
      out.append(f"forward widths ({largest} prompts, {r.mode}), width x count:")
      for name, counts in r.widths.items():
        out.append(f"  {name:8s}" + "  ".join(f"{w:>3d} x {c:<5d}" for w, c in sorted(counts.items())))
  return "\n".join(out)


def different_from_sequential(rows: Sequence[ThroughputRow]) -> list[ThroughputRow]:
  """Our modes whose tokens differ from the sequential run's at the same prompt count (the official one aside)."""
  sequential = {r.prompts: r for r in rows if r.mode == "sequential"}
  return [r for r in rows if not r.official and r.tokens != sequential[r.prompts].tokens]


def same_answers(row: ThroughputRow, reference: ThroughputRow) -> int:
  """How many of `row`'s answers are identical to `reference`'s."""
  return sum(a == b for a, b in zip(row.tokens, reference.tokens))
