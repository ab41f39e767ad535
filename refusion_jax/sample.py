"""Sample from a checkpoint on the command line.

    python -m refusion_jax.sample --hf_checkpoint DIR --prompt "What is 2+3?" --chat_template
    python -m refusion_jax.sample --checkpoint WORKDIR --prompt "..." --method ar --json
    python -m refusion_jax.sample --checkpoint TUNIX_DIR --model_config HF_DIR --prompt "..."   # tunix / MaxText
    python -m refusion_jax.sample --random_init tiny --prompt "hello" --trace trace.png

All prompts are decoded as one batch (with --batch_size K: K rows kept busy,
a finished row taking the next prompt). Without --json, each answer is printed
with its statistics (and with --trace, a coloured decode-order trace); with
--json, one JSON object per prompt. Bad input gives a one-line message and
exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import numpy as np

from refusion_jax.checkpoints.load import load
from refusion_jax.cli import UsageError, add_decode_flags, add_model_flags, decode_options, model_request, run_argparse
from refusion_jax.data.tokenizer import Tokenizer
from refusion_jax.decoding.methods import add_method_flags, method_value
from refusion_jax.decoding.result import DecodeResult
from refusion_jax.decoding.sampler import Sampler
from refusion_jax.decoding.trace_plot import format_trace_terminal, plot_trace


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python -m refusion_jax.sample",
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  add_model_flags(parser)

  prompts = parser.add_argument_group("prompts (one or more)")
  prompts.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a text prompt (repeatable).")
  prompts.add_argument(
    "--prompt_ids",
    action="append",
    default=[],
    metavar="1,2,3",
    help="a prompt as comma-separated token ids (repeatable).",
  )
  prompts.add_argument("--chat_template", action="store_true", help="wrap text prompts with the chat template.")

  decoding = parser.add_argument_group("decoding (a method's fields: unset ones take the method's defaults)")
  add_method_flags(decoding)
  add_decode_flags(parser.add_argument_group("decode options (`rj.DecodeOptions`)"))

  output = parser.add_argument_group("output")
  output.add_argument("--json", action="store_true", help="print one JSON object per prompt.")
  output.add_argument(
    "--trace",
    metavar="PNG",
    help="save the decode-order picture (one file per prompt: "
    "name-<i>.png when there are several) and print a coloured trace.",
  )
  return parser


def _parse_ids(text: str) -> list[int]:
  try:
    return [int(piece) for piece in text.split(",") if piece.strip()]
  except ValueError:
    raise UsageError(
      f"--prompt_ids {text!r} is not a comma-separated list of integers, e.g. --prompt_ids 1,2,3."
    ) from None


def trace_paths(path: str, count: int) -> list[str]:
  if count == 1:
    return [path]
  stem, suffix = os.path.splitext(path)
  return [f"{stem}-{i}{suffix or '.png'}" for i in range(count)]


def report(
  result: DecodeResult, prompts: list[str], answers: list[str], args: argparse.Namespace, tokenizer: Tokenizer
) -> None:
  """Print each prompt's answer (text or JSON) and write the traces."""
  paths = trace_paths(args.trace, len(answers)) if args.trace else [None] * len(answers)
  for row, (prompt, answer, path) in enumerate(zip(prompts, answers, paths)):
    if path:
      plot_trace(result, row, tokenizer=tokenizer, path=path)
    stats = dict(num_forwards=int(result.num_forwards[row]), tpf=float(result.tpf[row]), seconds=result.seconds)
    if result.logprobs is not None:
      stats["logprob"] = float(np.sum(result.logprobs[row, : len(result.tokens[row])]))
    if args.json:
      print(json.dumps(dict(tokens=result.tokens[row], text=answer, **stats)))
      continue
    print(f"[{row}] prompt: {prompt!r}")
    print(f"[{row}] answer: {answer!r}")
    print(
      f"[{row}] {len(result.tokens[row])} tokens, {stats['num_forwards']} forwards, TPF {stats['tpf']:.2f}, "
      f"{stats['seconds']:.2f}s for the batch"
      + (f", log-probability {stats['logprob']:.3f}" if "logprob" in stats else "")
    )
    if path:
      print(format_trace_terminal(result, row, tokenizer))
      print(f"[{row}] trace saved to {path}")


def run(args: argparse.Namespace) -> None:
  if not args.prompt and not args.prompt_ids:
    raise UsageError("Give at least one --prompt TEXT or --prompt_ids 1,2,3.")
  id_prompts = [_parse_ids(text) for text in args.prompt_ids]
  options = decode_options(args)
  model, tokenizer = load(**model_request(args), mesh=options.mesh)
  method = method_value(args.method, vars(args))
  sampler = Sampler(model, tokenizer, method, options, chat_template=args.chat_template)
  prompt_ids = [sampler.encode(text) for text in args.prompt] + id_prompts
  result = sampler.decode_ids(prompt_ids)
  answers = [tokenizer.decode(tokens) for tokens in result.tokens]
  shown = list(args.prompt) + [tokenizer.decode(ids) for ids in id_prompts]
  report(result, shown, answers, args, tokenizer)


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point; returns the exit status (2 on bad input)."""
  return run_argparse(build_parser(), run, argv)


if __name__ == "__main__":
  sys.exit(main())
