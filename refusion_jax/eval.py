"""Evaluate a checkpoint on a test set: accuracy per task, forwards, tokens per forward, speed.

    python -m refusion_jax.eval --checkpoint /tmp/refusion_demo --split test --method refusion --out r.json
    python -m refusion_jax.eval --checkpoint DIR --data results/test_set.json --method ar
    python -m refusion_jax.eval --checkpoint DIR --method mdm --steps 48,24,12 --block_length 16 --out_dir results/
    python -m refusion_jax.eval --checkpoint DIR --slot_size 4,8 --slot_threshold 0.6,0.9 --out_dir results/
    python -m refusion_jax.eval report RESULTS_DIR     # table.md + speed_accuracy.png from the JSON results
    python -m refusion_jax.eval curve WORKDIR          # a training run's validation exact match per task

The built-in split is the one training builds from its config (the data
section: tasks, seed, split size, chat template); decode flags default to the
config's evaluation settings. The config is the one the `--checkpoint` run
recorded in its workdir (`train_config.json`), so the command works from any
folder; `--config` replaces it, and is needed for a checkpoint that records
none (a Hugging Face directory, a run trained before runs recorded theirs).
Answers are checked like the training evaluation does: built-in tasks by
re-solving the query, other records by exact match after whitespace
normalisation. Compilation is timed apart from decoding
(see `refusion_jax.evaluation.runner`). Bad input gives a one-line message and
exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

import ml_collections

from refusion_jax.checkpoints.detect import detect
from refusion_jax.checkpoints.load import load
from refusion_jax.checkpoints.orbax import CHECKPOINT_SUBDIR
from refusion_jax.cli import UsageError, add_decode_flags, add_model_flags, decode_options, model_request, run_argparse
from refusion_jax.decoding.methods import add_method_flags
from refusion_jax.evaluation import curve, report, runner, sweep, test_sets
from refusion_jax.training.config_file import RUN_CONFIG_FILE, load_config, read_run_config, recorded_config_path

SPLITS = ("train", "validation", "test")


def _values(kind: type) -> Callable[[str], list]:
  """An argparse type: `4,8,16` -> [4, 8, 16]."""

  def parse(text: str) -> list:
    try:
      return [kind(piece) for piece in text.split(",") if piece.strip()]
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind.__name__} values") from None

  return parse


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python -m refusion_jax.eval",
    description=__doc__.split("\n\n")[0] + " (`report DIR` turns result files into a table and a plot).",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  add_model_flags(parser, random_init=False)

  data = parser.add_argument_group("test set (a built-in split, or --data)")
  data.add_argument(
    "--config",
    help="training config (path[:variant]) whose data and eval settings apply (default: the one the --checkpoint "
    f"run recorded, {RUN_CONFIG_FILE} in its workdir).",
  )
  data.add_argument("--split", choices=SPLITS, default="test", help="built-in task split, built as training does.")
  data.add_argument("--data", metavar="JSON", help='a JSON file of {"query", "response"[, "task"]} records instead.')
  data.add_argument("--num_examples", type=int, help="evaluate only the first N examples (default: all).")

  decoding = parser.add_argument_group(
    "decoding (a method's fields; defaults: the config's eval section, then the method's; comma-separated "
    "values sweep every combination)"
  )
  add_method_flags(decoding, values=_values)
  decoding.add_argument(
    "--repeats",
    type=int,
    default=1,
    help="timed runs of each batch (after a compiling first call); the median is reported.",
  )
  add_decode_flags(parser.add_argument_group("decode options (`rj.DecodeOptions`)"), rows_help="config eval.batch_size")

  output = parser.add_argument_group("output")
  output.add_argument("--out", metavar="JSON", help="write metrics, settings and every answer here (one setting).")
  output.add_argument("--out_dir", metavar="DIR", help="write one such file per decode setting here (sweeps).")
  output.add_argument("--model_name", help="the model's name in reports (default: the checkpoint's directory name).")
  output.add_argument("--label", help="the decode setting's name in reports (one setting; default: from the knobs).")
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


def build_curve_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python -m refusion_jax.eval curve",
    description="Write learning_curve.md and learning_curve.png (validation exact match per task against step) "
    "from a training workdir's TensorBoard events.",
  )
  parser.add_argument("workdir", help="the --workdir of a training run.")
  parser.add_argument("--out_dir", help="where the table and plot go (default: workdir).")
  parser.add_argument("--title", default="", help="a line above the table (and the plot's title).")
  return parser


def read_config(spec: str) -> ml_collections.ConfigDict:
  """`path[:variant]` of a training config file, as `train --config` takes it."""
  path, _, variant = spec.partition(":")
  if not os.path.isfile(path):
    raise UsageError(f"--config {path!r} is not a file; pass the training config, e.g. --config configs/demo.py.")
  return load_config(path, variant)


def training_config(args: argparse.Namespace) -> ml_collections.ConfigDict:
  """`--config` when given, else the config the `--checkpoint` run recorded in its workdir.

  Raises:
    UsageError: no `--config`, and the checkpoint records no config (naming the flag to pass).
    FileNotFoundError: `--checkpoint` holds no checkpoint.
  """
  if args.config:
    return read_config(args.config)
  recorded = None
  if args.checkpoint:
    found = detect(args.checkpoint, args.step)
    # A run of ours is found as WORKDIR/checkpoints; its config sits in WORKDIR.
    folders = [
      found.path,
      *([os.path.dirname(found.path)] if os.path.basename(found.path) == CHECKPOINT_SUBDIR else []),
    ]
    recorded = next((path for path in map(recorded_config_path, folders) if path), None)
  if recorded is None:
    source = args.checkpoint or args.hf_checkpoint
    raise UsageError(
      f"{source!r} records no training config ({RUN_CONFIG_FILE}, which training runs write into their workdir; "
      "a Hugging Face directory or an older run has none): pass the config whose data and eval settings apply, "
      "e.g. --config configs/demo.py (path[:variant])."
    )
  return read_run_config(recorded)


def result_path(out_dir: str, label: str) -> str:
  """`out_dir/<label>.json` with the label's spaces and slashes made file-name safe."""
  return os.path.join(out_dir, label.replace("/", "-").replace(" ", "_") + ".json")


def evaluate(args: argparse.Namespace) -> list[dict]:
  """Run the evaluations the flags describe (one per decode setting); returns their result records.

  Each record is also written to --out (one setting) or to --out_dir/<label>.json.
  """
  config = training_config(args)
  try:
    methods = sweep.method_sweep(args.method, vars(args), config.eval)
    examples, source = test_sets.load_examples(config, split=args.split, data=args.data, num_examples=args.num_examples)
  except ValueError as error:
    raise UsageError(str(error)) from error
  if len(methods) > 1 and (args.out or args.label):
    raise UsageError(f"The flags sweep {len(methods)} decode settings: use --out_dir instead of --out / --label.")
  options = decode_options(args, rows=config.eval.batch_size)
  model, tokenizer = load(**model_request(args), mesh=options.mesh)
  checkpoint = os.path.abspath(args.checkpoint or args.hf_checkpoint)
  records = []
  for method in methods:
    run = runner.run(
      model,
      tokenizer,
      examples,
      method=method,
      options=options,
      chat_template=config.data.chat_template,
      repeats=args.repeats,
      progress=not args.no_progress,
    )
    record = sweep.result_record(
      run,
      method,
      model=args.model_name or os.path.basename(checkpoint),
      label=args.label or method.label,
      checkpoint=checkpoint,
      step=args.step,
      batch_size=options.rows,
      repeats=args.repeats,
      data=source,
    )
    paths = [args.out] if args.out else []
    paths += [result_path(args.out_dir, record["label"])] if args.out_dir else []
    for path in paths:
      _write_json(record, path)
    print(format_summary(record) + "".join(f"\nwrote {path}" for path in paths), flush=True)
    records.append(record)
  return records


def _write_json(record: dict, path: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(record, f, indent=1)


def format_summary(record: dict) -> str:
  """The overall and per-task lines printed after an evaluation."""
  metrics = record["metrics"]
  lines = [f"{record['model']}, {record['label']} ({record['method']}, batch {record['batch_size']}):"]
  for name, group in [("all", metrics), *metrics["by_task"].items()]:
    lines.append(
      f"  {name:>8}: accuracy {group['accuracy']:.3f} over {group['count']}, "
      f"{group['mean_forwards']:.2f} forwards/answer, TPF {group['tpf']:.2f}, "
      f"{group['tokens_per_s']:.0f} tokens/s, latency {group['latency_s'] * 1e3:.1f} ms/batch, "
      f"{group['seconds_per_forward'] * 1e3:.2f} ms/forward"
    )
  lines.append(f"  compilation {metrics['compile_s']:.1f}s (excluded from the speeds above)")
  return "\n".join(lines)


def run_report(args: argparse.Namespace) -> None:
  paths = report.write_report(args.results_dir, args.out_dir or args.results_dir, title=args.title)
  print("\n".join(f"wrote {path}" for path in paths))


def run_curve(args: argparse.Namespace) -> None:
  paths = curve.write_curve(args.workdir, args.out_dir or args.workdir, title=args.title)
  print("\n".join(f"wrote {path}" for path in paths))


# First argument -> (parser, action) of a subcommand; anything else is an evaluation.
_SUBCOMMANDS = {"report": (build_report_parser, run_report), "curve": (build_curve_parser, run_curve)}


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point (`report DIR` / `curve WORKDIR` select the subcommands); returns the exit status, 2 on bad input."""
  argv = list(sys.argv[1:] if argv is None else argv)
  subcommand = _SUBCOMMANDS.get(argv[0]) if argv else None
  build, action = subcommand or (build_parser, evaluate)
  return run_argparse(build(), action, argv[1:] if subcommand else argv)


if __name__ == "__main__":
  sys.exit(main())
