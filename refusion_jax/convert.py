"""Convert a checkpoint of any supported format, or inspect one.

    python -m refusion_jax.convert /tunix/ckpts OUT --to hf --config /ckpt/Qwen3-0.6B
    python -m refusion_jax.convert /maxtext/run/checkpoints OUT --to refusion --config qwen3_0p6b --step 1000
    python -m refusion_jax.convert /ckpt/Qwen3-0.6B --inspect
    python -m refusion_jax.convert /ckpt/ReFusion OUT --to hf --lora /adapters/run1   # merged
    python -m refusion_jax.convert /runs/lora_demo OUT --to peft                     # a LoRA run's adapters

`--to hf` writes config.json + safetensors that transformers loads; `--to
refusion` writes a run directory (`OUT/checkpoints/<step>/{params,meta}`, no
optimizer or data state) to sample from or to start training with
`--config.init_from=OUT`. The tokenizer files of the source (or of `--config`
when it is a Hugging Face directory, or `--tokenizer`) are copied along.
tunix and MaxText store no architecture scalars: `--config` is required for
them. A model with LoRA adapters (a LoRA run, or `--lora DIR` with peft adapters)
is written merged (`W + scale·A·B`), or, with `--to peft`, as its adapters alone
in peft's format. Bad input gives a one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from refusion_jax.checkpoints.detect import FORMATS
from refusion_jax.checkpoints.export import convert
from refusion_jax.cli import DTYPES, run_argparse


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python -m refusion_jax.convert",
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument("source", metavar="SRC", help="a checkpoint: HF directory, training workdir, tunix / MaxText.")
  parser.add_argument("out", metavar="OUT", nargs="?", help="the directory to write (not with --inspect).")
  parser.add_argument(
    "--to", choices=("hf", "refusion", "peft"), help="the format to write (peft: the LoRA adapters alone)."
  )
  parser.add_argument("--inspect", action="store_true", help="print the format, stored arrays and inferred fields.")
  parser.add_argument("--format", default="auto", choices=("auto", *FORMATS), help="the format of SRC.")
  parser.add_argument("--config", help="preset name or HF directory with config.json (required for tunix / MaxText).")
  parser.add_argument("--step", type=int, help="the step of an orbax checkpoint (default: the latest).")
  parser.add_argument("--dtype", choices=DTYPES, help="dtype to write (default: stored).")
  parser.add_argument("--tokenizer", help="a tokenizer directory to copy along ('bytes' for the byte tokenizer).")
  parser.add_argument("--lora", metavar="DIR", help="a peft LoRA adapter directory to merge into SRC's model.")
  parser.add_argument(
    "--dequantize", action="store_true", help="write a quantized (int8 / int4) model's kernels as floats (q · scale)."
  )
  return parser


def run(args: argparse.Namespace) -> str:
  """Do what the flags ask; returns the line to print."""
  return convert(**vars(args))  # the flags are named as `convert`'s arguments


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point; returns the exit status (2 on bad input)."""
  return run_argparse(build_parser(), lambda args: print(run(args)), argv)


if __name__ == "__main__":
  sys.exit(main())
