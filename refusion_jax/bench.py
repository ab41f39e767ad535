"""Benchmarks. `decode`: ReFusion against its eager reference and the AR / MDM baselines;
`throughput`: many prompts one by one, in static batches and by continuous batching; `lora`: LoRA adapters
unmerged against merged; `quant`: int8 / int4 projections against bfloat16 (error, agreement, bytes, time per
forward); `serve`: the OpenAI-compatible server under concurrent clients against the Sampler.

    python -m refusion_jax.bench decode                       # tiny + small, sharpened random weights
    python -m refusion_jax.bench decode --random_init tiny --batch 4 --gen_length 32 --repeats 1
    python -m refusion_jax.bench decode --hf_checkpoint DIR --prompt "What is 3+4?"   # trained weights
    python -m refusion_jax.bench throughput                   # 8 and 64 prompts, 3-layer tiny model
    python -m refusion_jax.bench throughput --official_repo CHECKOUT   # + the official PyTorch code, same weights
    python -m refusion_jax.bench throughput --checkpoint WORKDIR --task_prompts sort,lookup,code \
        --gen_length 48 --slot_size 8 --serial_blocks 1                      # a trained demo checkpoint
    python -m refusion_jax.bench lora                         # LoRA decode cost (results/lora.md)
    python -m refusion_jax.bench quant --checkpoint WORKDIR   # int8 / int4 vs bf16 (results/quantization.md)
    python -m refusion_jax.bench serve --random_init tiny --prompts 64 --clients 16 --rows 8   # the HTTP server

Each mode runs its module of `refusion_jax.benchmarks` (`decode`, `throughput`, `lora`, `quant`, `serve`: what
each measures is said there), which formats its own table under the machine's name. All are timed alike
(`benchmarks.timer`): a warm-up call per variant (compilation excluded), then `--repeats` rounds interleaved
across the variants, the median and the spread reported. The random models of `decode` and `throughput` are
sharpened (`benchmarks.models`: --sharpen scales the LM head, EOS is never predicted) so that slots pass
verification as a trained model's do. Pass --hf_checkpoint / --checkpoint to measure trained weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from collections.abc import Sequence

from refusion_jax.benchmarks.decode import DecodeBenchOptions, format_table, run_decode_bench, summary
from refusion_jax.benchmarks.lora import LoraCostOptions, run_lora_cost
from refusion_jax.benchmarks.models import TrainedSource
from refusion_jax.benchmarks.quant import QuantBenchOptions, format_quant, run_quant_bench
from refusion_jax.benchmarks.serve import ServeBenchOptions, format_serve, run_serve_bench
from refusion_jax.benchmarks.throughput import ThroughputOptions, format_throughput, run_throughput_bench
from refusion_jax.checkpoints.load import load
from refusion_jax.cli import (
  UsageError,
  add_model_flags,
  add_old_flag,
  add_random_model_flags,
  has_model,
  model_request,
  run_argparse,
)
from refusion_jax.decoding.mdm import MDM
from refusion_jax.decoding.methods import add_method_flags, field_names, flag_values, method_value
from refusion_jax.decoding.refusion import ReFusion


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
  add_random_model_flags(p, "tiny,small", several=True)
  add_old_flag(p, "--sizes", "--random_init")
  p.add_argument("--batch", type=int, default=16, help="the large batch (batch 1 is always measured too).")
  p.add_argument("--repeats", type=int, default=3, help=REPEATS_HELP)
  _add_refusion_flags(p, serial_blocks=ReFusion().serial_blocks)
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
  add_random_model_flags(t, "tiny", several=False)
  add_old_flag(t, "--size", "--random_init")
  t.add_argument("--num_layers", type=int, default=3, help="random model: its layers (the preset's with 0).")
  t.add_argument("--repeats", type=int, default=3, help=REPEATS_HELP)
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

  lora = commands.add_parser(
    "lora",
    help="ReFusion decoding with LoRA adapters unmerged vs merged (results/lora.md).",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  for field in dataclasses.fields(LoraCostOptions):
    if field.name == "preset":
      add_random_model_flags(lora, field.default, several=False, seed=False)
      add_old_flag(lora, "--preset", "--random_init")
      continue
    lora.add_argument(
      f"--{field.name}", type=type(field.default), default=field.default, help=REPEATS_HELP * (field.name == "repeats")
    )

  q = commands.add_parser(
    "quant",
    help="int8 / int4 projections vs bfloat16: logit error, greedy agreement, bytes, time per forward.",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  for field in dataclasses.fields(QuantBenchOptions):
    if field.name == "preset":
      add_random_model_flags(q, field.default, several=False)
      add_old_flag(q, "--preset", "--random_init")
      add_old_flag(q, "--seed", "--init_seed", type=int)
    elif field.name != "seed":
      q.add_argument(f"--{field.name}", type=type(field.default), default=field.default, help=QUANT_HELP[field.name])

  s = commands.add_parser(
    "serve",
    help="the OpenAI server under concurrent clients vs the Sampler one by one and with K rows.",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  for name, field in ((f.name, f) for f in dataclasses.fields(ServeBenchOptions)):
    s.add_argument(
      f"--{name}",
      type=type(field.default),
      default=field.default,
      help=SERVE_HELP.get(name, "see benchmarks.serve."),
    )
  add_model_flags(s)
  add_method_flags(s.add_argument_group("decoding"))
  return parser


# What --repeats means in every mode (and in eval): benchmarks.timer's rounds.
REPEATS_HELP = "timed rounds after a warm-up call per variant, interleaved across the variants; median and spread."
SERVE_HELP = {
  "repeats": REPEATS_HELP,
  "workloads": "comma-separated: short, shared_prefix, mixed, probe (what each is: benchmarks.serve).",
  "system_tokens": "shared_prefix: the system prompt's tokens, the same in every request.",
  "longest_prompt": "mixed and probe: the longest prompt, the top of the large server's ladder of buckets.",
  "prefix_cache_tokens": "the servers' prefix cache where it is on.",
  "sharpen": "LM-head scale of a random model, so that slots pass as a trained model's do (1: as initialised).",
}
QUANT_HELP = {
  "checkpoint": "a trained run of the built-in tasks (its validation rows and queries); '': random weights.",
  "count": "teacher-forced rows (a quarter of them, at most, are the decode prompts without a checkpoint).",
  "length": "tokens per teacher-forced row.",
  "gen_length": "answer tokens of the greedy AR and the timed ReFusion decodes.",
  "repeats": REPEATS_HELP,
  "variants": "which to build (comma-separated); float32 and bfloat16 always run.",
}

# The fields of ReFusion a benchmark's flags set (its defaults, but serial_blocks where a benchmark says).
REFUSION_FLAGS = ("gen_length", "slot_size", "serial_blocks", "slot_threshold", "token_threshold")


def _add_refusion_flags(parser: argparse.ArgumentParser, serial_blocks: int) -> None:
  defaults = dataclasses.replace(ReFusion(), serial_blocks=serial_blocks)
  for name in REFUSION_FLAGS:
    value = getattr(defaults, name)
    parser.add_argument(f"--{name}", type=type(value), default=value, help="ReFusion decoding (docs/method.md §2).")


def _add_source_flags(parser: argparse.ArgumentParser) -> None:
  """A trained checkpoint with its prompts (cycled to the count needed), instead of random weights."""
  add_old_flag(parser, "--seed", "--init_seed", type=int)
  add_model_flags(parser, random_init=False, required=False)
  parser.add_argument("--prompt", action="append", default=[], help="with a checkpoint: prompt text (repeatable).")
  parser.add_argument("--chat_template", action="store_true", help="with a checkpoint: wrap prompts in the template.")
  parser.add_argument("--mask_id", type=int, help="with a checkpoint: the mask id if neither tokenizer nor config has.")


def _refusion(args: argparse.Namespace) -> ReFusion:
  return method_value("refusion", vars(args))


def _trained_source(args: argparse.Namespace) -> TrainedSource | None:
  """The checkpoint the flags name with its prompts, or None (random models)."""
  if not has_model(args):
    if args.prompt:
      raise UsageError("--prompt needs --hf_checkpoint or --checkpoint (random models get random prompts).")
    return None
  task_prompts = getattr(args, "task_prompts", None)
  return TrainedSource(
    model_request(args),
    texts=args.prompt,
    task_prompts=task_prompts.split(",") if task_prompts else (),
    chat_template=args.chat_template,
    mask_id=args.mask_id,
  )


# Option fields spelt as every command spells a random model (`cli.add_random_model_flags`).
_RANDOM_MODEL_FLAGS = {"preset": "random_init", "seed": "init_seed"}


def _fields(options: type, args: argparse.Namespace) -> dict:
  """The fields of the options dataclass `options` from the flags (a random model's under their common names)."""
  return {f.name: getattr(args, _RANDOM_MODEL_FLAGS.get(f.name, f.name)) for f in dataclasses.fields(options)}


def run(args: argparse.Namespace, argv: Sequence[str]) -> None:
  """Run the benchmark the flags (`argv`, parsed into `args`) name and print its report."""
  if args.command == "lora":
    options = LoraCostOptions(**_fields(LoraCostOptions, args))
    print(run_lora_cost(options).format())
    return
  if args.command == "quant":
    options = QuantBenchOptions(**_fields(QuantBenchOptions, args))
    print(format_quant(*run_quant_bench(options)))
    print(f"reproduce with: {reproduce_command(argv)}")
    return
  if args.command == "serve":
    model, tokenizer = load(**model_request(args))
    method = method_value(args.method, flag_values(args, field_names(args.method)))
    options = ServeBenchOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServeBenchOptions)})
    if options.sharpen != 1.0 and not args.random_init:
      raise UsageError("--sharpen scales a random model's LM head; a checkpoint's weights are measured as they are.")
    print(format_serve(run_serve_bench(model, tokenizer, method, options)))
    print(f"reproduce with: {reproduce_command(argv)}")
    return
  trained = _trained_source(args)
  if args.command == "throughput":
    options = ThroughputOptions(
      _refusion(args),
      prompts=args.prompts,
      batch_sizes=args.batch_sizes,
      repeats=args.repeats,
      size=args.random_init,
      num_layers=args.num_layers or None,
      dtype=args.dtype,
      sharpen=args.sharpen,
      seed=args.init_seed,
      official_repo=args.official_repo,
    )
    report = format_throughput(run_throughput_bench(options, trained))
  else:
    refusion = _refusion(args)
    options = DecodeBenchOptions(
      refusion,
      batch=args.batch,
      repeats=args.repeats,
      mdm=MDM(refusion.gen_length, block_length=args.mdm_block_length, steps=args.mdm_steps),
      sizes=args.random_init.split(","),
      sharpen=args.sharpen,
      seed=args.init_seed,
    )
    rows = run_decode_bench(options, trained)
    report = "\n\n".join([format_table(rows), summary(rows)])
  print(report)
  print(f"reproduce with: {reproduce_command(argv)}")


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point; returns the exit status (2 on bad input)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  return run_argparse(build_parser(), lambda args: run(args, argv), argv)


if __name__ == "__main__":
  sys.exit(main())
