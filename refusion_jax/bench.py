"""Benchmarks. `decode`: ReFusion against its eager reference and the AR / MDM baselines;
`throughput`: many prompts one by one, in static batches and by continuous batching.

    python -m refusion_jax.bench decode                       # tiny + small, sharpened random weights
    python -m refusion_jax.bench decode --sizes tiny --batch 4 --gen_length 32 --repeats 1
    python -m refusion_jax.bench decode --hf_checkpoint DIR --prompt "What is 3+4?"   # trained weights
    python -m refusion_jax.bench throughput                   # 8 and 64 prompts, 3-layer tiny model
    python -m refusion_jax.bench throughput --official_repo CHECKOUT   # + the official PyTorch code, same weights
    python -m refusion_jax.bench throughput --checkpoint WORKDIR --task_prompts sort,lookup,code \
        --gen_length 48 --slot_size 8 --serial_blocks 1                      # a trained demo checkpoint

For every model, in one run: the jitted ReFusion decoder and the eager
reference at batch 1 (same tokens, speed ratio), ReFusion vs AR vs MDM
(forwards per row, tokens per forward, tokens/s) at batch 1 and at --batch,
and the KV-cache bytes of the cached decoders. The first call of every
configuration compiles; it is timed apart ("compile" = first call − median
run) and the runs are the median of --repeats calls.

Random weights commit tokens arbitrarily and, near-uniform, would make every
ReFusion slot fail its thresholds. The random models are therefore
"sharpened": their LM head is scaled by --sharpen (confident, repetitive
predictions, so slots pass verification as a trained model's do) and EOS is
never predicted (every method writes all G tokens, so the counts compare).
Pass --hf_checkpoint / --checkpoint to measure trained weights instead.

`throughput` decodes N prompts (--prompts, several N in one run) with
ReFusion: each prompt alone (B = 1, sequential), the same with every forward
a whole block wide (the decoder before forwards were fitted to their work),
static batches of K, and K rows kept busy by continuous batching, with the
forwards per answer, batched forwards (loop iterations), their average width,
tokens/s and the ratio to the sequential run. Continuous K = 1 (in the default
--batch_sizes) runs the whole queue through one compiled call on a single row:
what it gains over the sequential run is the per-call host work (splitting the
model, starting the batch, reading back), and what K > 1 gains over it is the
rows sharing forwards. Modes are timed in interleaved
rounds so that machine noise hits all alike; every mode must give the same
tokens. It ends with the histogram of the forward widths per stage. With
--official_repo (a checkout of ML-GSAI/ReFusion) it also times the official
`generate.py` at B = 1 on the smallest N, on the same weights saved by
`save_hf` (`refusion_jax.evaluation.official`; torch is imported only then),
on our accelerator when torch reaches it (else the CPU) and in the model's
dtype (--dtype for the random model), and counts its answers identical to ours.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from refusion_jax.checkpoints.load import load
from refusion_jax.cli import add_model_flags, has_model, model_request, run_argparse
from refusion_jax.data import tasks
from refusion_jax.data.special_tokens import SpecialTokens, resolve_special_tokens
from refusion_jax.data.tokenizer import format_prompt
from refusion_jax.decoding import defaults
from refusion_jax.decoding.ar import ar_generate
from refusion_jax.decoding.checks import check_slot_layout
from refusion_jax.decoding.mdm import check_mdm_schedule, mdm_generate
from refusion_jax.decoding.prompts import bucket_length
from refusion_jax.decoding.reference import decode_reference
from refusion_jax.decoding.refusion import generate
from refusion_jax.decoding.result import DecodeResult
from refusion_jax.model import config as config_lib
from refusion_jax.model.cache import kv_cache_bytes
from refusion_jax.model.transformer import Transformer, init_model

PROMPT_LENGTHS = (8, 16)  # random prompts: lengths drawn in [8, 16], one bucket
THROUGHPUT_PROMPT_LENGTHS = (20, 27)  # the throughput workload's prompts (issue 12)


@dataclasses.dataclass
class BenchModel:
  """A model to benchmark, its prompts (the batch-1 run uses the first) and special ids."""

  name: str
  model: Transformer
  prompts: list[list[int]]
  mask_id: int
  eos_id: int
  pad_id: int


@dataclasses.dataclass
class Measurement:
  """One (model, method, batch) cell of the table."""

  model: str
  method: str
  batch: int
  forwards: float  # mean forwards per row
  tpf: float  # all answer tokens ÷ all forwards
  tokens_per_s: float  # answer tokens of the batch ÷ median run time
  compile_s: float  # first call − median run
  run_s: float  # median run time
  kv_cache_bytes: int | None  # None: the method keeps no cache
  tokens: list[list[int]]


def sharpen(model: Transformer, scale: float, never: int) -> Transformer:
  """Scale the LM head by `scale` and zero the logit of token `never` (in place).

  A zero logit sits in the middle of the scaled random logits, so greedy
  decoding never picks that token.
  """
  if model.config.tie_embeddings:
    raise ValueError("Sharpening scales the untied lm_head; this preset ties it to the embedding. Use --sharpen 1.")
  model.lm_head[...] = (model.lm_head[...] * scale).at[:, never].set(0.0)
  return model


def random_prompts(
  rng: np.random.Generator, count: int, vocab: int, lengths: tuple[int, int] = PROMPT_LENGTHS
) -> list[list[int]]:
  low, high = lengths
  return [rng.integers(0, vocab, size=int(rng.integers(low, high + 1))).tolist() for _ in range(count)]


def random_bench_model(
  size: str, batch: int, scale: float, seed: int, lengths: tuple[int, int] = PROMPT_LENGTHS, **overrides
) -> BenchModel:
  """A Qwen3-shaped preset (with `overrides`) with random (sharpened) weights; the last three ids are mask, EOS, pad."""
  base = config_lib.preset(size, **overrides)
  vocab = base.vocab_size
  model_config = base.replace(mask_token_id=vocab - 1, eos_token_id=vocab - 2, pad_token_id=vocab - 3)
  model = init_model(model_config, seed)
  if scale != 1.0:
    model = sharpen(model, scale, never=vocab - 2)
  prompts = random_prompts(np.random.default_rng(seed), batch, vocab - 3, lengths)
  name = size + "".join(f" {k}={v}" for k, v in overrides.items())
  return BenchModel(name, model, prompts, vocab - 1, vocab - 2, vocab - 3)


def trained_bench_model(args: argparse.Namespace) -> BenchModel:
  """The --hf_checkpoint / --checkpoint model; prompts from --task_prompts, --prompt (cycled to fill the
  batch) or random."""
  model, tokenizer = load(**model_request(args))
  special = resolve_special_tokens(SpecialTokens(mask=args.mask_id), tokenizer=tokenizer, config=model.config)
  if special.mask is None:
    raise ValueError("Neither the tokenizer nor the model config names a mask token; pass --mask_id.")
  texts = args.prompt
  if getattr(args, "task_prompts", None):
    examples = tasks.generate_examples("test", args.batch, tasks=tuple(args.task_prompts.split(",")))
    texts = [example["query"] for example in examples]
  if texts:
    encoded = [tokenizer.encode(format_prompt(tokenizer, p, args.chat_template)) for p in texts]
    prompts = [encoded[i % len(encoded)] for i in range(args.batch)]
  else:
    vocab = min(model.config.vocab_size, tokenizer.vocab_size)
    prompts = random_prompts(np.random.default_rng(args.seed), args.batch, vocab)
  name = args.hf_checkpoint or args.checkpoint
  return BenchModel(name, model, prompts, special.mask, special.eos, special.padding)


def _log(message: str) -> None:
  print(f"[bench] {message}", file=sys.stderr, flush=True)


def measure(label: str, call: Callable[[], DecodeResult], repeats: int) -> tuple[DecodeResult, float, float]:
  """(result, compile seconds, median run seconds) of `call`, the first call being the warm-up."""
  start = time.perf_counter()
  result = call()
  first = time.perf_counter() - start
  _log(f"{label}: first call (compile + run) {first:.2f}s")
  runs = []
  for i in range(repeats):
    start = time.perf_counter()
    result = call()
    runs.append(time.perf_counter() - start)
    _log(f"{label}: run {i + 1}/{repeats} {runs[-1]:.2f}s")
  median = statistics.median(runs)
  return result, max(first - median, 0.0), median


def refusion_knobs(bench: BenchModel, args: argparse.Namespace) -> dict:
  """ReFusion's knobs from the flags, with the bench model's mask id."""
  names = ("gen_length", "slot_size", "serial_blocks", "slot_threshold", "token_threshold")
  return dict({name: getattr(args, name) for name in names}, mask_id=bench.mask_id)


def decoders(bench: BenchModel, args: argparse.Namespace) -> dict[str, Callable[[list[list[int]]], DecodeResult]]:
  """Each method as a function of the prompts, with the run's knobs bound."""
  ids = dict(eos_id=bench.eos_id, pad_id=bench.pad_id)
  refusion = refusion_knobs(bench, args)
  return {
    "refusion": lambda p: generate(bench.model, p, **refusion, **ids),
    "refusion eager ref.": lambda p: decode_reference(bench.model, p[0], **refusion, eos_id=bench.eos_id),
    "ar": lambda p: ar_generate(bench.model, p, gen_length=args.gen_length, **ids),
    "mdm": lambda p: mdm_generate(
      bench.model,
      p,
      gen_length=args.gen_length,
      block_length=args.mdm_block_length,
      steps=args.mdm_steps,
      mask_id=bench.mask_id,
      **ids,
    ),
  }


def bench_decode(bench: BenchModel, args: argparse.Namespace) -> list[Measurement]:
  """Every method at batch 1 and at the full batch (the eager reference at batch 1 only)."""
  capacity = bucket_length(max(len(p) for p in bench.prompts)) + args.gen_length
  # The eager reference keeps growing host arrays rather than a fixed-capacity cache.
  cached = {"refusion", "ar"}
  rows = []
  for batch in sorted({1, len(bench.prompts)}):
    prompts = bench.prompts[:batch]
    for method, call in decoders(bench, args).items():
      if method == "refusion eager ref." and batch > 1:
        continue
      label = f"{bench.name} {method} batch {batch}"
      result, compile_s, run_s = measure(label, functools.partial(call, prompts), args.repeats)
      answer_tokens = sum(len(t) for t in result.tokens)
      rows.append(
        Measurement(
          model=bench.name,
          method=method,
          batch=batch,
          forwards=float(np.mean(result.num_forwards)),
          tpf=result.overall_tpf,
          tokens_per_s=answer_tokens / run_s,
          compile_s=compile_s,
          run_s=run_s,
          kv_cache_bytes=kv_cache_bytes(bench.model.config, batch, capacity) if method in cached else None,
          tokens=result.tokens,
        )
      )
  return rows


def _bytes(count: int | None) -> str:
  if count is None:
    return "-"
  for unit in ("B", "KiB", "MiB", "GiB"):
    if count < 1024 or unit == "GiB":
      return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
    count /= 1024
  raise AssertionError("unreachable")


def format_table(rows: Sequence[Measurement]) -> str:
  """A fixed-width text table, one line per measurement."""
  header = ("model", "method", "batch", "fwd/row", "TPF", "tokens/s", "compile s", "run s", "KV cache")
  lines = [
    (
      r.model,
      r.method,
      str(r.batch),
      f"{r.forwards:.1f}",
      f"{r.tpf:.2f}",
      f"{r.tokens_per_s:.1f}",
      f"{r.compile_s:.2f}",
      f"{r.run_s:.3f}",
      _bytes(r.kv_cache_bytes),
    )
    for r in rows
  ]
  return _table(header, lines)


def _table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
  """Fixed-width columns: the first two left-aligned (names), the others right-aligned (numbers)."""
  widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
  fmt = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
  rule = "-" * len(fmt(header))
  return "\n".join([fmt(header), rule, *map(fmt, lines)])


def summary(rows: Sequence[Measurement]) -> str:
  """Per model: jitted vs eager speed and agreement, and the batching speed-up of each method."""
  out = []
  for name in dict.fromkeys(r.model for r in rows):
    cell = {(r.method, r.batch): r for r in rows if r.model == name}
    jitted, eager = cell[("refusion", 1)], cell[("refusion eager ref.", 1)]
    same = "same tokens" if jitted.tokens == eager.tokens else "DIFFERENT tokens"
    out.append(f"{name}: jitted ReFusion is {eager.run_s / jitted.run_s:.1f}x the eager reference at batch 1 ({same}).")
    batch = max(b for _, b in cell)
    if batch > 1:
      gains = ", ".join(
        f"{m} {cell[(m, batch)].tokens_per_s / cell[(m, 1)].tokens_per_s:.1f}x" for m in ("refusion", "ar", "mdm")
      )
      out.append(f"{name}: tokens/s at batch {batch} over batch 1: {gains}.")
  return "\n".join(out)


# ------------------------------------------------------------------ throughput


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
  run_s: float  # median over the rounds
  widths: dict[str, dict[int, int]]
  tokens: list[list[int]]


def throughput_modes(bench: BenchModel, args: argparse.Namespace) -> dict[str, Callable[[list], list[DecodeResult]]]:
  """Each mode as prompts -> its decode results: one call per prompt, per static batch, or one continuous call."""
  decode = functools.partial(
    generate, bench.model, **refusion_knobs(bench, args), eos_id=bench.eos_id, pad_id=bench.pad_id
  )
  modes = {
    "sequential": lambda ps: [decode([p]) for p in ps],
    "sequential, full width": lambda ps: [decode([p], fit_width=False) for p in ps],
  }
  for k in args.batch_sizes:
    if k > 1:  # static batches of 1 are the sequential mode
      modes[f"static {k}"] = lambda ps, k=k: [decode(ps[i : i + k]) for i in range(0, len(ps), k)]
  for k in args.batch_sizes:
    modes[f"continuous {k}"] = lambda ps, k=k: [decode(ps, batch_size=k)]
  if args.official_repo:
    from refusion_jax.evaluation.official import OfficialDecoder  # imports torch: only when asked for

    official = OfficialDecoder(bench.model, args.official_repo)
    knobs = dict(refusion_knobs(bench, args), eos_id=bench.eos_id)
    modes[f"{OFFICIAL} {official.device.type} {bench.model.config.dtype}"] = lambda ps: [official.decode(ps, **knobs)]
  return modes


# The official PyTorch decoder's mode (B = 1, prompt by prompt; its label adds the torch device and the dtype);
# timed on the smallest prompt count only.
OFFICIAL = "official PyTorch"


def _merge_widths(results: Sequence[DecodeResult]) -> dict[str, dict[int, int]]:
  merged: dict[str, dict[int, int]] = {}
  for result in results:
    for name, counts in result.widths.items():
      for width, count in counts.items():
        merged.setdefault(name, {})[width] = merged.get(name, {}).get(width, 0) + count
  return merged


def _rows_of(mode: str, count: int) -> int:
  """K of a mode: 1 one by one (sequential, official), else the mode's batch size."""
  return 1 if mode.startswith(("sequential", OFFICIAL)) else min(int(mode.split()[-1]), count)


def bench_throughput(bench: BenchModel, args: argparse.Namespace) -> list[ThroughputRow]:
  """Every mode on the first N prompts for each N of --prompts, timed in interleaved rounds."""
  modes = throughput_modes(bench, args).items()
  smallest = min(args.prompts)
  cells = [
    (n, mode, call) for n in args.prompts for mode, call in modes if not mode.startswith(OFFICIAL) or n == smallest
  ]
  results, times = {}, {}
  for n, mode, call in cells:  # warm-up: compiles every shape the timed rounds use
    start = time.perf_counter()
    results[n, mode] = call(bench.prompts[:n])
    _log(f"{n} prompts, {mode}: first call (compile + run) {time.perf_counter() - start:.2f}s")
  for round_ in range(args.repeats):
    for n, mode, call in cells:
      start = time.perf_counter()
      call(bench.prompts[:n])
      times.setdefault((n, mode), []).append(time.perf_counter() - start)
    _log(f"round {round_ + 1}/{args.repeats} done")
  rows = []
  for n, mode, _ in cells:
    calls = results[n, mode]
    widths = _merge_widths(calls)
    forward = widths.get("forward", {})
    tokens = [t for r in calls for t in r.tokens]
    run_s = statistics.median(times[n, mode])
    rows.append(
      ThroughputRow(
        prompts=n,
        mode=mode,
        rows=_rows_of(mode, n),
        forwards_per_answer=float(np.mean(np.concatenate([r.num_forwards for r in calls]))),
        batch_forwards=sum(forward.values()),
        average_width=sum(w * c for w, c in forward.items()) / max(sum(forward.values()), 1),
        tokens_per_s=sum(map(len, tokens)) / run_s,
        run_s=run_s,
        widths=widths,
        tokens=tokens,
      )
    )
  return rows


def format_throughput(rows: Sequence[ThroughputRow]) -> str:
  """The table, the same-tokens check, and the per-stage width histograms of the largest prompt count."""
  sequential = {r.prompts: r for r in rows if r.mode == "sequential"}
  header = ("prompts", "mode", "K", "fwd/answer", "batch fwds", "avg width", "tokens/s", "run s", "vs sequential")
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
      f"{sequential[r.prompts].run_s / r.run_s:.2f}x",
    )
    for r in rows
  ]
  out = [_table(header, lines), ""]
  ours = [r for r in rows if not r.mode.startswith(OFFICIAL)]
  different = [f"{r.prompts} prompts {r.mode}" for r in ours if r.tokens != sequential[r.prompts].tokens]
  out.append(f"DIFFERENT tokens from sequential: {different}" if different else "every mode: the same tokens.")
  for r in rows:
    if r.mode.startswith(OFFICIAL):
      reference = sequential[r.prompts]
      same = sum(a == b for a, b in zip(r.tokens, reference.tokens))
      out.append(
        f"{r.prompts} prompts at B = 1: the jitted decoder is {r.run_s / reference.run_s:.1f}x faster than the "
        f"official code ({r.mode}); {same} of {r.prompts} answers identical."
      )
  largest = max(sequential)
  for r in rows:
    if r.prompts == largest and (r.mode == "sequential" or (r.mode.startswith("continuous") and r.rows > 1)):
      out.append(f"forward widths ({largest} prompts, {r.mode}), width x count:")
      for name, counts in r.widths.items():
        out.append(f"  {name:8s}" + "  ".join(f"{w:>3d} x {c:<5d}" for w, c in sorted(counts.items())))
  return "\n".join(out)


def run_throughput(args: argparse.Namespace) -> list[ThroughputRow]:
  if args.repeats < 1 or min(args.prompts) < 1 or min(args.batch_sizes) < 1:
    raise ValueError("--repeats, --prompts and --batch_sizes must be at least 1.")
  check_slot_layout(args.gen_length, args.slot_size, args.serial_blocks)
  if has_model(args):
    args.batch = max(args.prompts)
    bench = trained_bench_model(args)
  else:
    overrides = dict(num_layers=args.num_layers) if args.num_layers else {}
    if args.dtype:
      overrides.update(dtype=args.dtype, param_dtype=args.dtype)
    lengths = THROUGHPUT_PROMPT_LENGTHS
    bench = random_bench_model(args.size, max(args.prompts), args.sharpen, args.seed, lengths, **overrides)
  _log(f"{bench.name}: {len(bench.prompts)} prompts of {min(map(len, bench.prompts))}-{max(map(len, bench.prompts))}")
  return bench_throughput(bench, args)


def reproduce_command(argv: Sequence[str]) -> str:
  return shlex.join(["python", "-m", "refusion_jax.bench", *argv])


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m refusion_jax.bench", description=__doc__.split("\n\n")[0])
  commands = parser.add_subparsers(dest="command", required=True)
  p = commands.add_parser(
    "decode",
    help="ReFusion vs eager reference vs AR vs MDM decoding.",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  p.add_argument("--sizes", default="tiny,small", help="comma-separated model presets (random weights).")
  p.add_argument("--batch", type=int, default=16, help="the large batch (batch 1 is always measured too).")
  p.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up; the median is reported.")
  _add_refusion_flags(p, serial_blocks=defaults.REFUSION_KNOBS["serial_blocks"])
  p.add_argument("--mdm_block_length", type=int, help="MDM tokens per block (default min(32, gen_length)).")
  p.add_argument("--mdm_steps", type=int, help="MDM unmasking steps in all (default gen_length: one token per step).")
  p.add_argument("--sharpen", type=float, default=128.0, help="LM-head scale of the random models (1: plain init).")
  _add_source_flags(p)

  t = commands.add_parser(
    "throughput",
    help="ReFusion over many prompts: sequential, static batches, continuous batching.",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  ints = lambda text: [int(x) for x in text.split(",")]
  t.add_argument("--prompts", type=ints, default=[8, 64], help="comma-separated prompt counts N.")
  t.add_argument("--batch_sizes", type=ints, default=[1, 8, 16], help="comma-separated K of the batched modes.")
  t.add_argument("--size", default="tiny", choices=sorted(config_lib.PRESETS), help="random model preset.")
  t.add_argument("--num_layers", type=int, default=3, help="random model: its layers (the preset's with 0).")
  t.add_argument("--repeats", type=int, default=3, help="interleaved timed rounds after the warm-up; medians.")
  _add_refusion_flags(t, serial_blocks=2)
  t.add_argument("--sharpen", type=float, default=64.0, help="LM-head scale of the random model.")
  t.add_argument(
    "--official_repo",
    help="a checkout of ML-GSAI/ReFusion: also time its generate.py on the same weights (B = 1, smallest N; torch).",
  )
  t.add_argument(
    "--task_prompts",
    help="with a checkpoint: prompts are the test-split queries of these built-in tasks (comma-separated).",
  )
  _add_source_flags(t)
  return parser


def _add_refusion_flags(parser: argparse.ArgumentParser, serial_blocks: int) -> None:
  parser.add_argument("--gen_length", type=int, default=defaults.GEN_LENGTH, help="G, answer tokens at most.")
  for name, value in dict(defaults.REFUSION_KNOBS, serial_blocks=serial_blocks).items():
    parser.add_argument(f"--{name}", type=type(value), default=value, help="ReFusion decoding (docs/method.md §2).")


def _add_source_flags(parser: argparse.ArgumentParser) -> None:
  """Random weights' seed, or a trained checkpoint with its prompts (cycled to the count needed)."""
  parser.add_argument("--seed", type=int, default=0, help="weights and prompts of the random models.")
  add_model_flags(parser, random_init=False, required=False)
  parser.add_argument("--prompt", action="append", default=[], help="with a checkpoint: prompt text (repeatable).")
  parser.add_argument("--chat_template", action="store_true", help="with a checkpoint: wrap prompts in the template.")
  parser.add_argument("--mask_id", type=int, help="with a checkpoint: the mask id if neither tokenizer nor config has.")


def check_args(args: argparse.Namespace) -> None:
  """Reject bad knobs before anything is built or compiled."""
  if args.batch < 1 or args.repeats < 1:
    raise ValueError(f"--batch ({args.batch}) and --repeats ({args.repeats}) must be at least 1.")
  mdm = defaults.method_defaults("mdm", args.gen_length)
  args.mdm_block_length = args.mdm_block_length or mdm["block_length"]
  args.mdm_steps = args.mdm_steps or mdm["steps"]
  check_slot_layout(args.gen_length, args.slot_size, args.serial_blocks)
  check_mdm_schedule(args.gen_length, args.mdm_block_length, args.mdm_steps)
  unknown = [s for s in args.sizes.split(",") if s not in config_lib.PRESETS]
  if unknown:
    raise ValueError(f"Unknown --sizes {unknown}; choose among {sorted(config_lib.PRESETS)}.")
  if args.prompt and not has_model(args):
    raise ValueError("--prompt needs --hf_checkpoint or --checkpoint (random models get random prompts).")


def run_decode(args: argparse.Namespace) -> list[Measurement]:
  check_args(args)
  if has_model(args):
    benches = [lambda: trained_bench_model(args)]
  else:
    benches = [
      lambda size=size: random_bench_model(size, args.batch, args.sharpen, args.seed) for size in args.sizes.split(",")
    ]
  rows = []
  for build in benches:
    bench = build()
    _log(
      f"{bench.name}: {sum(x.size for x in jax.tree.leaves(nnx.state(bench.model))):,} parameters, "
      f"{len(bench.prompts)} prompts of {min(map(len, bench.prompts))}-{max(map(len, bench.prompts))} tokens"
    )
    rows += bench_decode(bench, args)
  return rows


def run(args: argparse.Namespace, argv: Sequence[str]) -> None:
  """Run the benchmark the flags (`argv`, parsed into `args`) name and print its report."""
  if args.command == "throughput":
    report = format_throughput(run_throughput(args))
  else:
    rows = run_decode(args)
    report = "\n\n".join([format_table(rows), summary(rows)])
  print(report)
  print(f"backend: {jax.default_backend()} ({jax.device_count()} device(s)); reproduce with: {reproduce_command(argv)}")


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point; returns the exit status (2 on bad input)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  return run_argparse(build_parser(), lambda args: run(args, argv), argv)


if __name__ == "__main__":
  sys.exit(main())
