"""Serve a model over HTTP with OpenAI's API: completions and chat, streamed or not (docs/serving.md).

    python -m refusion_jax.serve --random_init tiny --tokenizer bytes             # a random tiny model, for a try
    python -m refusion_jax.serve --checkpoint WORKDIR --rows 8                    # a trained demo run
    python -m refusion_jax.serve --checkpoint HF_DIR --paper_task gsm8k_cot --dtype bfloat16 --mesh data:-1
    curl 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
      -d '{"model": "tiny", "prompt": "2 + 2 =", "max_tokens": 16}'

The model and decoding flags are `python -m refusion_jax.sample`'s. K rows
(`--rows`) decode continuously: a request joins at the next loop-call
boundary (`--chunk_iterations`), with its own max_tokens, temperature, seed,
top_k/top_p/min_p, stop strings (up to --max_stop) and stop ids, n answers per
prompt and several prompts. A decode loop is compiled and warmed for each of a
ladder of prompt buckets (`--prompt_buckets`, `--bucket_rows`) before the
server listens, for prompts up to `--max_prompt_tokens` (by default what the
model's context holds with the answer), and nothing compiles again (/metrics
counts compilations); prompts that begin alike share their KV
(`--prefix_cache_tokens`); a failed warm-up exits with status 1 and its cause.
The server binds 127.0.0.1 unless --host says otherwise; with --api_key (or
REFUSION_API_KEY) every path but /health needs `Authorization: Bearer KEY`.
SIGTERM stops admitting and ends within --shutdown_seconds, exit status 0; an
engine that dies or hangs for --watchdog_seconds turns /health to 503 and ends
the server with status 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence

from refusion_jax.checkpoints.load import load
from refusion_jax.cli import UsageError, add_decode_flags, add_model_flags, decode_options, model_request, run_argparse
from refusion_jax.decoding.ladder import FULL_ROWS_UP_TO, LADDER_STEP, SMALLEST_BUCKET
from refusion_jax.decoding.methods import add_method_flags, field_names, flag_values, method_value
from refusion_jax.decoding.paper import PAPER_TASKS, paper_method
from refusion_jax.serving.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_STOP, DEFAULT_WATCHDOG_SECONDS
from refusion_jax.serving.auth import API_KEY_ENV, server_key
from refusion_jax.serving.server import ServerFailure, ServerOptions, build_server

# The server keeps a prefix cache by default: prompts that begin alike (a system prompt, a few-shot header, the n
# choices of one prompt) prefill only what differs.
DEFAULT_PREFIX_CACHE_TOKENS = 8192


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python -m refusion_jax.serve",
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  add_model_flags(parser)
  decoding = parser.add_argument_group("decoding (a request's temperature and seed override these)")
  add_method_flags(decoding)
  decoding.add_argument(
    "--paper_task",
    choices=sorted(PAPER_TASKS),
    help="refusion: the paper's settings for this task (G = 512); the method's flags given override them.",
  )
  add_decode_flags(
    parser.add_argument_group("decode options (`rj.DecodeOptions`)"),
    rows=8,
    rows_help="8",
    seed_help="a new one for each request that gives none",
    chunk_iterations=8,
    prefix_cache_tokens=DEFAULT_PREFIX_CACHE_TOKENS,
  )

  server = parser.add_argument_group("server")
  server.add_argument(
    "--max_prompt_tokens",
    type=int,
    help="the longest prompt (default: what the model's context holds with an answer of --gen_length tokens).",
  )
  server.add_argument(
    "--prompt_buckets",
    type=_counts,
    help=f"the prompt buckets compiled at start, comma-separated and increasing, the last at least "
    f"--max_prompt_tokens; a prompt runs in the smallest that holds it (default: {SMALLEST_BUCKET}, x{LADDER_STEP} "
    "each, then --max_prompt_tokens).",
  )
  server.add_argument(
    "--bucket_rows",
    type=_counts,
    help=f"the rows of each prompt bucket, comma-separated (default: --rows up to {FULL_ROWS_UP_TO} tokens, fewer "
    f"above: the rows that --rows x ({FULL_ROWS_UP_TO} + G) cache tokens hold, at least 1).",
  )
  server.add_argument("--max_queue", type=int, default=64, help="requests held beyond the K rows before 429s.")
  server.add_argument("--host", default="127.0.0.1", help="the address to bind (0.0.0.0: every interface).")
  server.add_argument("--port", type=int, default=8000)
  server.add_argument("--api_key", help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else none).")
  server.add_argument("--served_model_name", help="the model id clients send (default: the checkpoint's name).")
  server.add_argument("--max_body_bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get 413.")
  server.add_argument(
    "--shutdown_seconds", type=int, default=30, help="after SIGTERM, how long held requests may finish."
  )
  server.add_argument(
    "--max_stop", type=int, default=DEFAULT_MAX_STOP, help="the most stop strings (and stop ids) a request may give."
  )
  server.add_argument(
    "--watchdog_seconds",
    type=float,
    default=DEFAULT_WATCHDOG_SECONDS,
    help="a loop call running longer than this (a hung device) turns /health to 503 and ends the server (status 1).",
  )
  server.add_argument("--log_level", default="info", choices=("debug", "info", "warning", "error"))
  return parser


def _counts(text: str) -> tuple[int, ...]:
  """A comma-separated list of positive integers (a flag's value)."""
  try:
    values = tuple(int(part) for part in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 64,256,1024") from None
  if any(value < 1 for value in values):
    raise argparse.ArgumentTypeError(f"{text!r}: every value must be positive.")
  return values


def method_from_flags(args: argparse.Namespace):
  """The method value the flags ask for: --paper_task's, with the method's flags given replacing its fields."""
  given = flag_values(args, field_names(args.method))
  if args.paper_task is None:
    return method_value(args.method, given)
  if args.method != PAPER_TASKS[args.paper_task].name:
    raise UsageError(f"--paper_task sets {PAPER_TASKS[args.paper_task].name}'s settings, not --method {args.method}'s.")
  return paper_method(args.paper_task, **given)


def model_name(args: argparse.Namespace) -> str:
  """--served_model_name, else the checkpoint's folder name, else the preset's name."""
  if args.served_model_name:
    return args.served_model_name
  source = args.checkpoint or args.hf_checkpoint
  return os.path.basename(os.path.normpath(source)) if source else f"{args.random_init}-random"


def run(args: argparse.Namespace) -> None:
  log = logging.getLogger("refusion_jax.serving")  # request lines beside uvicorn's, whatever else set up logging
  handler = logging.StreamHandler()
  handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
  log.addHandler(handler)
  log.setLevel(args.log_level.upper())
  log.propagate = False
  if args.max_stop < 1 or args.watchdog_seconds <= 0:
    raise UsageError("--max_stop must be at least 1 and --watchdog_seconds above 0.")
  method = method_from_flags(args)
  key = server_key(args.api_key)
  decode = decode_options(args)
  model, tokenizer = load(**model_request(args), mesh=decode.mesh)
  options = ServerOptions(
    method=method,
    decode=decode,
    max_prompt_tokens=args.max_prompt_tokens,
    prompt_buckets=args.prompt_buckets,
    bucket_rows=args.bucket_rows,
    max_queue=args.max_queue,
    seed=args.seed,
    model_name=model_name(args),
    api_key=key,
    max_body_bytes=args.max_body_bytes,
    shutdown_seconds=args.shutdown_seconds,
    log_level=args.log_level,
    max_stop=args.max_stop,
    watchdog_seconds=args.watchdog_seconds,
  )
  server = build_server(model, tokenizer, options, host=args.host, port=args.port)
  # uvicorn re-raises the signal that stopped it once it is done; these handlers make that a clean exit 0.
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: None)
  server.run()
  if server.failure is not None:
    raise ServerFailure(server.failure)


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point; returns the exit status (2 on bad input, 0 after SIGTERM, 1 when the warm-up failed or the
  engine died or hung)."""
  try:
    return run_argparse(build_parser(), run, argv)
  except ServerFailure as failure:
    print(f"error: {failure}", file=sys.stderr)
    return 1


if __name__ == "__main__":
  sys.exit(main())
