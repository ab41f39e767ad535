"""What the command-line entry points share: the model flags, turning them into a load request, and reporting.

Every entry point (`train`, `sample`, `bench`, `train_bench`, `eval`, `aot`,
`convert`, `harness`) reports input it cannot use the same way: one line `error: ...` on
stderr and exit status 2, never a traceback (`report_errors`). Entry points
import this module and the library, never each other (tests/test_public_api.py).

Two flag libraries, by necessity: the commands driven by a training config
(`train`, `aot`, `train_bench`) use absl, because ml_collections'
`--config.field=value` overrides are absl flags; the others use argparse, whose
subcommands (`bench decode`, `eval report`) and repeatable flags
(`--prompt`) they rely on.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from refusion_jax.checkpoints.detect import FORMATS
from refusion_jax.checkpoints.orbax import quiet_checkpoint_noise
from refusion_jax.decoding.options import OPTION_NAMES, DecodeOptions
from refusion_jax.deprecation import warn_deprecated
from refusion_jax.model import config as config_lib
from refusion_jax.model import quant
from refusion_jax.parallel.mesh_spec import parse_mesh_spec
from refusion_jax.parallel.sharding import make_mesh

# Errors that mean "this input cannot be used": reported as one line, exit status 2.
BAD_INPUT = (ValueError, FileNotFoundError, NotImplementedError)
DTYPES = ("float32", "bfloat16", "float16")


def initialize_distributed(*, service_apart: bool = False, **timeouts: int) -> None:
  """Join the job's processes (launch/): Cloud TPU pods are auto-detected; a local run
  gives JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID.

  service_apart: process 0 runs the job's coordination service in a process of its own, so that the others
    outlive it (training/coordinator.py; training asks for it).
  timeouts: `jax.distributed.initialize`'s (heartbeat_timeout_seconds, initialization_timeout,
    shutdown_timeout_seconds); training passes its `config.faults` (training/faults.py), the rest JAX's defaults.
  """
  import jax

  count, index = os.environ.get("JAX_NUM_PROCESSES"), os.environ.get("JAX_PROCESS_ID")
  options = dict(
    num_processes=None if count is None else int(count),
    process_id=None if index is None else int(index),
    **timeouts,
  )
  if service_apart:
    from refusion_jax.training import coordinator

    options.update(coordinator.start_apart(**options))
  jax.distributed.initialize(**options)


class UsageError(ValueError):
  """Bad command-line input, reported without a traceback."""


def report_errors(run: Callable[[], object], *, errors: tuple[type[BaseException], ...] = BAD_INPUT, status: int = 2):
  """Run a command; an error of `errors` becomes `error: <message>` on stderr and `status`, else 0.

  Also installs the process-wide filters that keep checkpoint-library noise
  (tracebacks orbax logs for failures we report ourselves) out of the output:
  they belong to the program, not to the library.
  """
  quiet_checkpoint_noise()
  try:
    run()
  except errors as error:
    print(f"error: {error}", file=sys.stderr)
    return status
  return 0


def run_argparse(
  parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], object], argv: Sequence[str] | None
) -> int:
  """Parse `argv` (None: the process's) and `run` the command; returns the exit status (2 on bad input)."""
  try:
    args = parser.parse_args(argv)
  except SystemExit as exit_:  # argparse has printed its message
    return int(exit_.code or 0)
  return report_errors(lambda: run(args))


def add_model_flags(parser: argparse.ArgumentParser, random_init: bool = True, required: bool = True) -> None:
  """The flags `model_request` reads: where the model and tokenizer come from, and the dtype.

  random_init: offer `--random_init PRESET` (a random model with the byte tokenizer).
  required: one source must be given (False: the model is optional, e.g. a benchmark's random models).
  """
  title = "model (exactly one)" if required else "trained model (optional)"
  source = parser.add_argument_group(title)
  source.add_argument(
    "--checkpoint",
    metavar="PATH",
    help="any checkpoint: a training workdir, a Hugging Face directory, a tunix or MaxText checkpoint (root, step "
    "or item folder); the format is detected (see --format).",
  )
  source.add_argument(
    "--hf_checkpoint", metavar="DIR", help="a Hugging Face checkpoint directory (--checkpoint DIR --format hf)."
  )
  source.add_argument(
    "--format", default="auto", choices=("auto", *FORMATS), help="with --checkpoint: its format (default: detect)."
  )
  source.add_argument(
    "--model_config",
    metavar="CONFIG",
    help="with --checkpoint: the architecture (a preset name or a Hugging Face directory with config.json, whose "
    "tokenizer is then used too); required for tunix and MaxText, which store none.",
  )
  source.add_argument("--step", type=int, help="with --checkpoint: the step to load (default: the latest).")
  if random_init:
    source.add_argument(
      "--random_init",
      metavar="PRESET",
      choices=sorted(config_lib.PRESETS),
      help="demo on a randomly initialised model of this preset with the byte tokenizer.",
    )
    source.add_argument("--init_seed", type=int, default=0, help="with --random_init: the weights' seed.")
  parser.add_argument(
    "--tokenizer",
    help="'bytes' or a directory with tokenizer.json (default: the checkpoint's tokenizer; without one, "
    "prompts must be token ids; 'bytes' with --random_init).",
  )
  parser.add_argument("--dtype", choices=DTYPES, help="activation and parameter dtype (default: as stored).")
  parser.add_argument(
    "--quantize",
    choices=quant.MODES,
    help="int8 or int4 projection kernels, quantized while loading (default: as stored; docs/architecture.md, "
    "'Quantized weights').",
  )
  parser.add_argument(
    "--quantize_group_size",
    type=int,
    default=128,
    help="with --quantize int4: inputs per scale (0: one scale per output channel).",
  )
  parser.add_argument(
    "--lora",
    metavar="DIR",
    help="a peft LoRA adapter directory (adapter_config.json + adapter_model.safetensors) to add to the model, "
    "unmerged (a LoRA training run of ours needs none: its checkpoint loads with its adapters).",
  )


def has_model(args: argparse.Namespace) -> bool:
  """Whether the model flags name a model."""
  return any(getattr(args, name, None) for name in ("checkpoint", "hf_checkpoint", "random_init"))


def model_request(args: argparse.Namespace) -> dict:
  """The keyword arguments of `refusion_jax.checkpoints.load.load` that the model flags ask for.

  Raises:
    UsageError: no source or several, or a flag that does not apply to the source given.
  """
  sources = {
    "hf": getattr(args, "hf_checkpoint", None),
    args.format: getattr(args, "checkpoint", None),
    "preset": getattr(args, "random_init", None),
  }
  given = {format: source for format, source in sources.items() if source}
  names = "--checkpoint PATH, --hf_checkpoint DIR" + (", --random_init PRESET" if "random_init" in args else "")
  if len(given) != 1 or (args.hf_checkpoint and args.checkpoint):
    raise UsageError(f"Give exactly one of {names}.")
  if (args.step is not None or args.model_config) and not args.checkpoint:
    raise UsageError("--step and --model_config only apply to --checkpoint.")
  ((format, source),) = given.items()
  if format == "hf" and not os.path.isdir(source):
    raise UsageError(f"--hf_checkpoint {source!r} is not a directory.")
  return dict(
    source=source,
    format=format,
    config=args.model_config,
    step=args.step,
    tokenizer=args.tokenizer,
    dtype=args.dtype,
    seed=getattr(args, "init_seed", 0),
    lora=getattr(args, "lora", None),
    quantize=getattr(args, "quantize", None),
    quantize_group_size=getattr(args, "quantize_group_size", 128),
  )


class _OldRowsFlag(argparse.Action):
  """`--batch_size K`, the 0.2 name of `--rows K`: sets rows, with a `DeprecationWarning` naming the new flag."""

  def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None):
    warn_deprecated("the flag --batch_size", "--rows (the rows the decode loop keeps busy)")
    namespace.rows = values


def add_decode_flags(
  parser: argparse.ArgumentParser | argparse._ArgumentGroup,
  *,
  rows: int | None = None,
  rows_help: str = "all prompts of a call at once",
  seed_help: str = "0",
  chunk_iterations: int | None = None,
  prefix_cache_tokens: int = 0,
) -> None:
  """The flags of `DecodeOptions`, alike in every command that decodes (`decode_options` reads them back):
  --rows, --seed, --mask_id, --eos_id, --pad_id, --mesh, --chunk_iterations, --logprobs, --prefix_cache_tokens. The
  arguments set a command's own defaults and the help that says what an unset flag means."""
  parser.add_argument(
    "--rows", type=int, default=rows, help=f"K, the rows the decode loop keeps busy (default: {rows_help})."
  )
  parser.add_argument("--batch_size", type=int, action=_OldRowsFlag, help=argparse.SUPPRESS)
  parser.add_argument("--seed", type=int, help=f"the sampling seed (default: {seed_help}).")
  for name in ("mask_id", "eos_id", "pad_id"):
    parser.add_argument(f"--{name}", type=int, help="default: the tokenizer's, else the model config's.")
  parser.add_argument("--mesh", help="decode on a mesh of this host's chips, e.g. data:-1 or fsdp:2+tensor:4.")
  parser.add_argument(
    "--chunk_iterations",
    type=int,
    default=chunk_iterations,
    help="loop iterations per call (default: until the host must refill the queue).",
  )
  parser.add_argument(
    "--logprobs",
    action="store_true",
    default=None,
    help='also report each answer token\'s log-probability (docs/sampling.md, "Log-probabilities").',
  )
  parser.add_argument(
    "--prefix_cache_tokens",
    type=int,
    default=prefix_cache_tokens,
    help="prompt tokens whose KV is kept for later prompts that begin alike (0: off).",
  )


def decode_options(args: argparse.Namespace, **defaults: Any) -> DecodeOptions:
  """The `DecodeOptions` that `add_decode_flags`' flags ask for; `defaults` fill what the flags leave unset
  (e.g. `rows=config.eval.batch_size`).

  Raises:
    UsageError: a value `DecodeOptions` refuses, or a mesh that does not fit the devices.
  """
  values = {name: getattr(args, name, None) for name in OPTION_NAMES if name != "mesh"}
  values = {name: defaults.get(name) if value is None else value for name, value in values.items()}
  try:
    mesh = make_mesh(parse_mesh_spec(args.mesh)) if getattr(args, "mesh", None) else None
    return DecodeOptions(**{name: value for name, value in values.items() if value is not None}, mesh=mesh)
  except ValueError as error:
    raise UsageError(str(error)) from error


def add_old_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, old: str, new: str, **kwargs: Any) -> None:
  """`old`, a renamed flag: hidden from --help, it sets what `new` sets (its `dest`), with a `DeprecationWarning`
  that names `new`."""

  class Renamed(argparse.Action):
    def __call__(self, parser, namespace, values, option=None):  # noqa: ANN001
      warn_deprecated(f"the flag {old}", new)
      setattr(namespace, self.dest, values)

  parser.add_argument(old, action=Renamed, dest=new.lstrip("-"), help=argparse.SUPPRESS, **kwargs)


def add_random_model_flags(
  parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: str, *, several: bool, seed: bool = True
) -> None:
  """A random model, named as every command names one: `--random_init PRESET` (comma-separated presets where a
  benchmark compares several) and, with `seed`, `--init_seed`, the weights' seed."""
  presets = ", ".join(sorted(config_lib.PRESETS))
  what = "comma-separated presets" if several else "a preset"
  parser.add_argument("--random_init", default=default, metavar="PRESET", help=f"random weights of {what} ({presets}).")
  if seed:
    parser.add_argument("--init_seed", type=int, default=0, help="the random weights' (and random prompts') seed.")
