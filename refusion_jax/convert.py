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
import os
import shutil
import sys
from collections.abc import Sequence

from flax import nnx

from refusion_jax.checkpoints import orbax as refusion
from refusion_jax.checkpoints.detect import FORMATS, Found
from refusion_jax.checkpoints.hf import save_hf
from refusion_jax.checkpoints.load import inspect_checkpoint, load_model, locate
from refusion_jax.checkpoints.peft import save_lora
from refusion_jax.cli import run_argparse
from refusion_jax.data.tokenizer import load_tokenizer
from refusion_jax.model.lora import merge_lora

# What a tokenizer directory holds beside tokenizer.json.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
TOKENIZER_SUBDIR = "tokenizer"


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
  parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="dtype to write (default: stored).")
  parser.add_argument("--tokenizer", help="a tokenizer directory to copy along ('bytes' for the byte tokenizer).")
  parser.add_argument("--lora", metavar="DIR", help="a peft LoRA adapter directory to merge into SRC's model.")
  return parser


def _copy_tokenizer(directory: str | None, out: str) -> None:
  """Copy the tokenizer files of `directory` (if it is a tokenizer directory, not "bytes") into `out`."""
  if directory in (None, "bytes"):
    return
  os.makedirs(out, exist_ok=True)
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(directory, name)):
      shutil.copy(os.path.join(directory, name), os.path.join(out, name))


def _tokenizer_source(args: argparse.Namespace, found: Found) -> str | None:
  """The tokenizer that goes with the converted model: "bytes", a directory holding tokenizer.json, or None."""
  if args.tokenizer:
    load_tokenizer(args.tokenizer)  # refuses, naming it, a directory without tokenizer.json
    return args.tokenizer
  if found.format == "refusion":
    candidate = refusion.refusion_source(found.path, found.step)[1]
  else:
    candidate = found.path if found.format == "hf" else args.config
  if candidate == "bytes" or (candidate and os.path.isfile(os.path.join(candidate, "tokenizer.json"))):
    return candidate
  return None


def write_refusion(model: nnx.Module, out: str, step: int, tokenizer: str | None) -> None:
  """A run directory holding only the parameters and the meta item (the model config and tokenizer)."""
  directory = os.path.join(refusion.local_path(out), refusion.CHECKPOINT_SUBDIR)
  if tokenizer not in (None, "bytes"):
    _copy_tokenizer(tokenizer, os.path.join(directory, TOKENIZER_SUBDIR))
    tokenizer = TOKENIZER_SUBDIR
  with refusion.Checkpoints(directory, async_save=False) as checkpoints:
    checkpoints.save_model(step, params=nnx.state(model), meta=refusion.model_meta(model.config, tokenizer))
    checkpoints.wait()


def run(args: argparse.Namespace) -> str:
  """Do what the flags ask; returns the line to print."""
  if args.inspect:
    if args.out or args.to:
      raise ValueError("--inspect takes only SRC (and --format / --step).")
    return str(inspect_checkpoint(args.source, format=args.format, step=args.step))
  if not args.out or not args.to:
    raise ValueError("Give SRC OUT --to hf|refusion|peft, or SRC --inspect.")
  found = locate(args.source, args.format, args.step)
  model = load_model(
    args.source, format=found.format, config=args.config, step=args.step, dtype=args.dtype, lora=args.lora
  )
  if args.to == "peft":
    save_lora(model, args.out, base_model_name_or_path=args.source)
    return f"wrote the LoRA adapters of the {found.description} to {args.out} (peft format)"
  model = merge_lora(model)
  tokenizer = _tokenizer_source(args, found)
  if args.to == "hf":
    save_hf(model, args.out)
    _copy_tokenizer(tokenizer, args.out)
  else:
    write_refusion(model, args.out, found.step or 0, tokenizer)
  note = "" if tokenizer else " (no tokenizer found to copy: pass --tokenizer)"
  return f"wrote {args.to} checkpoint {args.out} from the {found.description}{note}"


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point; returns the exit status (2 on bad input)."""
  return run_argparse(build_parser(), lambda args: print(run(args)), argv)


if __name__ == "__main__":
  sys.exit(main())
