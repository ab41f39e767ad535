"""lm-evaluation-harness's command line with our model registered as `refusion_jax` (the paper's table).

    python -m refusion_jax.harness --model_args checkpoint=/ckpt,paper_task=gsm8k_cot,batch_size=32 \\
        --tasks gsm8k_cot --apply_chat_template --output_path out --log_samples

Every lm-eval flag works as lm-eval documents it; `--model` defaults to
`refusion_jax`, whose `--model_args` keys are `ReFusionLM.MODEL_ARGS`
(refusion_jax/evaluation/harness.py). With `--output_path`, each task's
decode statistics go to OUTPUT_PATH/refusion_stats/TASK/final_stats.json
(and, with `--log_samples`, sample_stats.jsonl) unless `stats_dir=` is given.

On a pod or a multi-GPU host every process runs the same command (with
REFUSION_DISTRIBUTED=1, as launch/ sets it): the model is sharded over the
global mesh, lm-eval sees one process on every host, and only process 0
writes results. A bad `--model_args` value prints why and exits with status 2.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import jax

from refusion_jax.cli import initialize_distributed

# lm-eval flags that write files: only process 0 keeps them.
_WRITING_FLAGS = ("--output_path", "-o", "--log_samples", "-s", "--wandb_args", "--hf_hub_log_args")


def _value(argv: list[str], *names: str) -> str | None:
  """The value of the last `--name VALUE` / `--name=VALUE` in argv (None when absent)."""
  found = None
  for i, arg in enumerate(argv):
    for name in names:
      if arg == name and i + 1 < len(argv):
        found = argv[i + 1]
      elif arg.startswith(name + "="):
        found = arg.split("=", 1)[1]
  return found


def _drop_writing_flags(argv: list[str]) -> list[str]:
  """argv without the flags that write results (for processes other than 0)."""
  kept, skip = [], False
  for arg in argv:
    if skip:
      skip = False
      continue
    name = arg.split("=", 1)[0]
    if name in _WRITING_FLAGS:
      takes_value = name not in ("--log_samples", "-s") and "=" not in arg
      skip = takes_value
      continue
    kept.append(arg)
  return kept


def lm_eval_argv(argv: Sequence[str], process_index: int = 0) -> list[str]:
  """Our command line as lm-eval's: `--model refusion_jax` by default; with --output_path the stats go beside
  lm-eval's results (stats_dir=, sample_stats= from --log_samples); processes other than 0 write nothing."""
  argv = list(argv)
  if _value(argv, "--model") is None:
    argv = ["--model", "refusion_jax", *argv]
  output_path = _value(argv, "--output_path", "-o")
  model_args = _value(argv, "--model_args")
  if _value(argv, "--model") == "refusion_jax" and output_path and process_index == 0:
    extra = []
    if model_args is None or "stats_dir=" not in model_args:
      extra.append(f"stats_dir={os.path.join(output_path, 'refusion_stats')}")
    if ("--log_samples" in argv or "-s" in argv) and (model_args is None or "sample_stats=" not in model_args):
      extra.append("sample_stats=true")
    if extra:
      joined = ",".join([model_args, *extra] if model_args else extra)
      argv = [a for a in argv if not a.startswith("--model_args=")]
      if "--model_args" in argv:
        argv[argv.index("--model_args") + 1] = joined
      else:
        argv += ["--model_args", joined]
  if process_index != 0:
    argv = _drop_writing_flags(argv)
  return argv


def main(argv: Sequence[str] | None = None) -> int:
  """Run lm-eval's command line on `argv` (default: sys.argv[1:]); returns the exit status."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if os.environ.get("REFUSION_DISTRIBUTED"):
    initialize_distributed()
  from lm_eval.__main__ import cli_evaluate
  from lm_eval.utils import simple_parse_args_string

  from refusion_jax.evaluation.harness import HarnessArgumentError, check_model_args, register

  register()
  argv = lm_eval_argv(argv, jax.process_index())
  saved = sys.argv
  sys.argv = ["lm-eval", *argv]
  try:
    if _value(argv, "--model") == "refusion_jax":  # fail fast: lm-eval indexes its tasks before making the model
      check_model_args(simple_parse_args_string(_value(argv, "--model_args") or ""))
    cli_evaluate()
  except HarnessArgumentError as error:
    print(f"error: {error}", file=sys.stderr)  # as every entry point reports bad input (refusion_jax/cli.py)
    return 2
  finally:
    sys.argv = saved
  return 0


if __name__ == "__main__":
  sys.exit(main())
