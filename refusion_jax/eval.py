"""Evaluate a checkpoint on a test set: accuracy per task, forwards, tokens per forward, speed.

    python -m refusion_jax.eval --checkpoint /tmp/refusion_demo --split test --method refusion --out r.json
    python -m refusion_jax.eval --checkpoint DIR --data results/test_set.json --method ar
    python -m refusion_jax.eval --checkpoint DIR --method mdm --steps 24 --block_length 48
    python -m refusion_jax.eval report RESULTS_DIR     # table.md + speed_accuracy.png from the JSON results

The built-in split is the one training builds from `--config` (its data
section: tasks, seed, split size, chat template); decode flags default to the
config's evaluation settings. Answers are checked like the training
evaluation does: built-in tasks by re-solving the query, other records by exact
match after whitespace normalisation. Compilation is timed apart from decoding
(see `refusion_jax.evaluation.runner`). Bad input gives a one-line message and
exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import ml_collections

from refusion_jax.evaluation import adapters, report, runner
from refusion_jax.training.config_file import load_config

SPLITS = ("train", "validation", "test")
# Decoder keyword -> the training config's `eval` field that gives its default.
_CONFIG_KNOBS = dict(
  gen_length="gen_length",
  slot_size="slot_size",
  serial_blocks="serial_blocks",
  slot_threshold="slot_threshold",
  token_threshold="token_threshold",
  block_length="mdm_block_length",
  steps="mdm_steps",
)


class UsageError(ValueError):
  """Bad command-line input, reported without a traceback."""


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python -m refusion_jax.eval",
    description=__doc__.split("\n\n")[0] + " (`report DIR` turns result files into a table and a plot).",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  model = parser.add_argument_group("model")
  model.add_argument("--checkpoint", required=True, help="a training workdir or a Hugging Face directory.")
  model.add_argument("--step", type=int, help="training workdir: the step to load (default: the latest).")
  model.add_argument("--tokenizer", help="'bytes' or a tokenizer directory (default: the checkpoint's).")

  data = parser.add_argument_group("test set (a built-in split, or --data)")
  data.add_argument(
    "--config", default="configs/demo.py", help="training config (path[:variant]) whose data and eval settings apply."
  )
  data.add_argument("--split", choices=SPLITS, default="test", help="built-in task split, built as training does.")
  data.add_argument("--data", metavar="JSON", help='a JSON file of {"query", "response"[, "task"]} records instead.')
  data.add_argument("--num_examples", type=int, help="evaluate only the first N examples (default: all).")

  knobs = parser.add_argument_group("decoding (defaults: the config's eval section)")
  knobs.add_argument("--method", choices=adapters.METHODS, default="refusion")
  knobs.add_argument("--batch_size", type=int, help="prompts decoded together (default: config eval.batch_size).")
  knobs.add_argument("--gen_length", type=int, help="G, answer tokens at most.")
  knobs.add_argument("--slot_size", type=int, help="refusion: S, tokens per slot.")
  knobs.add_argument("--serial_blocks", type=int, help="refusion: NB, blocks decoded left to right.")
  knobs.add_argument("--slot_threshold", type=float, help="refusion: plan confidence to choose a slot.")
  knobs.add_argument("--token_threshold", type=float, help="refusion: AR probability to accept a token.")
  knobs.add_argument("--block_length", type=int, help="mdm: tokens per block.")
  knobs.add_argument("--steps", type=int, help="mdm: total unmasking steps.")
  knobs.add_argument("--temperature", type=float, default=0.0)
  knobs.add_argument("--seed", type=int, default=0)

  output = parser.add_argument_group("output")
  output.add_argument("--out", metavar="JSON", help="write metrics, settings and every answer here.")
  output.add_argument("--model_name", help="the model's name in reports (default: the checkpoint's directory name).")
  output.add_argument("--label", help="the decode setting's name in reports (default: method and knobs).")
  output.add_argument("--no_progress", action="store_true", help="no progress bar.")
  return parser


def build_report_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python -m refusion_jax.eval report",
    description="Write table.md and speed_accuracy.png from the result JSON files of a directory.",
  )
  parser.add_argument("results_dir", help="directory searched (recursively) for result files written by --out.")
  parser.add_argument("--out_dir", help="where the table and plot go (default: results_dir).")
  parser.add_argument("--title", default="", help="a line above the table.")
  return parser


def read_config(spec: str) -> ml_collections.ConfigDict:
  """`path[:variant]` of a training config file, as `train --config` takes it."""
  path, _, variant = spec.partition(":")
  if not os.path.isfile(path):
    raise UsageError(f"--config {path!r} is not a file; pass the training config, e.g. --config configs/demo.py.")
  return load_config(path, variant)


def decode_knobs(args: argparse.Namespace, config: ml_collections.ConfigDict) -> dict:
  """The chosen method's decoder arguments: the flags given, else the config's eval settings."""
  options = adapters.decode_options(args.method)
  knobs = {}
  for name in options:
    value = getattr(args, name, None)
    if value is None and name in _CONFIG_KNOBS:
      value = config.eval.get(_CONFIG_KNOBS[name])
    if value is not None:
      knobs[name] = value
  if args.method == "mdm":
    # The config's MDM block may exceed a --gen_length given on the command line.
    knobs["block_length"] = min(knobs["block_length"], knobs["gen_length"])
    knobs["steps"] = min(knobs["steps"], knobs["gen_length"])
  return knobs


def load_examples(args: argparse.Namespace, config: ml_collections.ConfigDict) -> tuple[list[dict], dict]:
  """The test examples and a description of where they came from."""
  if args.data:
    if not os.path.isfile(args.data):
      raise UsageError(f"--data {args.data!r} is not a file; pass a JSON list of query/response records.")
    examples, source = adapters.json_examples(args.data), dict(file=os.path.abspath(args.data))
  else:
    data = config.data
    if data.dataset != "tasks":
      raise UsageError(f"--config {args.config} trains on data.dataset={data.dataset!r}; pass its test file as --data.")
    size = data.get(f"num_{args.split}")
    examples = adapters.task_examples(args.split, size, seed=data.seed, task_names=data.tasks)
    source = dict(split=args.split, tasks=sorted(set(data.tasks)), seed=data.seed, split_size=size)
  if args.num_examples is not None:
    if args.num_examples < 1:
      raise UsageError(f"--num_examples={args.num_examples} must be at least 1.")
    examples = examples[: args.num_examples]
  return examples, source


def default_label(method: str, knobs: dict) -> str:
  """A short name for reports, e.g. `refusion S8 0.9/0.5` or `mdm 24 steps`."""
  if method == "refusion":
    return f"refusion S{knobs['slot_size']} {knobs['slot_threshold']:g}/{knobs['token_threshold']:g}"
  if method == "mdm":
    return f"mdm {knobs['steps']} steps"
  return method


def evaluate(args: argparse.Namespace) -> dict:
  """Run the evaluation the flags describe; returns the result record (also written to --out)."""
  config = read_config(args.config)
  knobs = decode_knobs(args, config)
  examples, source = load_examples(args, config)
  model, tokenizer = adapters.load_checkpoint(args.checkpoint, args.step, args.tokenizer)
  batch_size = args.batch_size or config.eval.batch_size
  run = runner.run(
    model,
    tokenizer,
    examples,
    method=args.method,
    knobs=knobs,
    batch_size=batch_size,
    chat_template=config.data.chat_template,
    progress=not args.no_progress,
  )
  record = dict(
    model=args.model_name or os.path.basename(os.path.abspath(args.checkpoint)),
    label=args.label or default_label(args.method, knobs),
    checkpoint=os.path.abspath(args.checkpoint),
    step=args.step,
    method=args.method,
    knobs=knobs,
    batch_size=batch_size,
    data=source,
    metrics=runner.summarize(run),
    answers=[vars(answer) for answer in run.answers],
  )
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(record, f, indent=1)
  return record


def format_summary(record: dict) -> str:
  """The overall and per-task lines printed after an evaluation."""
  metrics = record["metrics"]
  lines = [f"{record['model']}, {record['label']} ({record['method']}, batch {record['batch_size']}):"]
  for name, group in [("all", metrics), *metrics["by_task"].items()]:
    lines.append(
      f"  {name:>8}: accuracy {group['accuracy']:.3f} over {group['count']}, "
      f"{group['mean_forwards']:.2f} forwards/answer, TPF {group['tpf']:.2f}, "
      f"{group['tokens_per_s']:.0f} tokens/s, latency {group['latency_s'] * 1e3:.1f} ms/batch"
    )
  lines.append(f"  compilation {metrics['compile_s']:.1f}s (excluded from the speeds above)")
  return "\n".join(lines)


def run_report(args: argparse.Namespace) -> None:
  paths = report.write_report(args.results_dir, args.out_dir or args.results_dir, title=args.title)
  print("\n".join(f"wrote {path}" for path in paths))


def run_eval(args: argparse.Namespace) -> None:
  record = evaluate(args)
  print(format_summary(record))
  if args.out:
    print(f"wrote {args.out}")


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point (`report DIR` as the first arguments selects the report); returns the exit status, 2 on bad input."""
  argv = list(sys.argv[1:] if argv is None else argv)
  is_report = argv[:1] == ["report"]
  parser, action = (build_report_parser(), run_report) if is_report else (build_parser(), run_eval)
  try:
    action(parser.parse_args(argv[1:] if is_report else argv))
  except SystemExit as exit_:  # argparse has printed its message
    return int(exit_.code or 0)
  except (ValueError, FileNotFoundError) as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
