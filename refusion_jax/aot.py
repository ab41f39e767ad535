"""Compile a training config ahead of time for a TPU topology (or the local devices) and report what fits.

    python -m refusion_jax.aot --config configs/refusion_qwen3_8b.py --topology v5p:4x4x4
    python -m refusion_jax.aot --config configs/refusion_qwen3_8b.py --topology v5p:2x2x1 \\
        --config.grad_accum_steps=4 --decode_batch=1,32 --decode_mesh=tensor:4
    python -m refusion_jax.aot --config configs/demo.py:smoke      # the local devices
    python -m refusion_jax.aot --config configs/refusion_qwen3_8b.py --topology v5p:2x2x2 --programs train \\
        --remat_policies=full,projections_except_mlp,projections        # one row per remat policy
    python -m refusion_jax.aot --config configs/refusion_qwen3_8b.py --topology v5e:2x2 --config.mesh.data=1 \
        --programs decode --decode_mesh=data:1 --decode_batch=1,8 --quantize int8   # int8 decode on one v5e chip
    python -m refusion_jax.aot --config configs/grpo_qwen3_8b.py --topology v5p:2x2x1 --programs grpo  # GRPO

Compiles (a) the training step at the config's batch, sequence length,
gradient accumulation and mesh (once per `--remat_policies` entry, one row
each, to compare their memory and FLOPs), and (b) the ReFusion decode loop (prefill +
plan-and-infill while_loop) per `--decode_batch`, at `--decode_prompt_length`
+ `config.eval.gen_length` on `--decode_mesh`; `--programs grpo` compiles a GRPO step's programs
(`config.grpo`, refusion_jax.rl.trainer) as the trainer builds them: the rollout's decode loop, the reference
log-probabilities (beta > 0) and the update, at batch_size x num_generations rows. Nothing is allocated and no
TPU is needed: a topology is described by libtpu (`pip install
"jax[tpu]==<your jax version>"`). For each program it prints the per-device
memory (arguments, outputs, temporaries, total) against the chip's HBM, the
compiled FLOPs and bytes, a roofline *estimate* of its time and its compile time; it exits with
status 1, saying what to change, when something does not fit.

The programs are built by `refusion_jax.training.aot_report` (a GRPO step's by
`refusion_jax.rl.aot_report`), from
`config.model`'s shapes (preset + overrides), not from `init_from`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import jax
from absl import app, flags
from ml_collections import config_flags

from refusion_jax.cli import report_errors
from refusion_jax.model import quant
from refusion_jax.parallel import compiled
from refusion_jax.parallel.mesh_spec import parse_mesh_spec
from refusion_jax.rl.aot_report import grpo_reports
from refusion_jax.training.aot_report import decode_mesh_ways, decode_reports, train_reports

# What --programs takes: a GRPO step's rollout and update (a config with a `grpo` section), the supervised
# training step, the decode loop.
_PROGRAMS = ("grpo", "train", "decode")


def _print_each(reports: Iterator[compiled.Report]) -> list[compiled.Report]:
  """Print each report's row as its compile finishes (a big one takes minutes); returns them all."""
  done = []
  for report_ in reports:
    done.append(report_)
    print(compiled.format_table([report_]), flush=True)
  return done


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  status = report_errors(lambda: report(flags.FLAGS))
  if status:
    sys.exit(status)


def report(f: flags.FlagValues) -> None:
  """Compile what the flags ask for and print the reports; exits with status 1 when something does not fit."""
  if f.quantize is not None:
    f.config.quantize = f.quantize
  devices = compiled.topology_devices(f.topology) if f.topology else jax.devices()
  chip = compiled.chip_of(devices[0], f.hbm_gib)
  decode_mesh = parse_mesh_spec(f.decode_mesh) if f.decode_mesh else dict(f.config.mesh)
  print(f"{len(devices)} devices ({devices[0].device_kind}){'' if chip else ', HBM unknown (pass --hbm_gib)'}")
  reports = []
  unknown = sorted(set(f.programs) - set(_PROGRAMS))
  if unknown:
    raise ValueError(f"--programs={','.join(f.programs)}: unknown {unknown}; choose from {', '.join(_PROGRAMS)}.")
  if "grpo" in f.programs:
    if "grpo" not in f.config:
      raise ValueError(
        "--programs=grpo compiles a GRPO step: give a config with a `grpo` section (e.g. configs/grpo_qwen3_8b.py)."
      )
    reports += _print_each(grpo_reports(f.config, devices, chip))
  if "train" in f.programs:
    reports += _print_each(train_reports(f.config, devices, chip, f.remat_policies))
  if "decode" in f.programs:
    source = "--decode_mesh" if f.decode_mesh else "config.mesh; --decode_mesh=... to choose another"
    name, ways = decode_mesh_ways(f.config, devices, decode_mesh)
    print(
      f"Decode mesh {name} ({source}): rows padded to a multiple of its {ways} "
      "batch-parallel devices, as generate(..., mesh=) pads them.",
      flush=True,
    )
    batches = [int(b) for b in f.decode_batch]
    reports += _print_each(decode_reports(f.config, devices, chip, batches, f.decode_prompt_length, decode_mesh))
  print("\n" + compiled.format_table(reports))
  print(
    "Per device; GB = 1e9 bytes. TFLOP and GB accessed are the compiler's counts (a loop body counted once, "
    "times grad_accum for the training step; nothing inside a custom kernel such as splash attention); "
    "'estimated s' is a roofline estimate (max of compute at peak FLOP/s, on the largest of the compiler's, "
    "the traced and the model's FLOPs, and memory traffic at peak bandwidth, no communication), not a "
    "measurement; 'MFU est.' is the model FLOPs of rows full of real tokens over the chip's peak for that time. "
    "With layers scanned the compiler counts one layer, so TFLOP is the traced program's matrix products "
    "('traced': every loop at its trip count, recomputation included, custom kernels not) and the estimate is "
    "compute time alone."
  )
  print("Compile times on this host: " + "; ".join(f"{r.name}: {r.compile_seconds:.0f} s" for r in reports))
  advice = [f"- {r.name}: {tip}" for r in reports for tip in r.advice]
  failed = [r for r in reports if r.fits is False]
  for r in failed:
    print(f"DOES NOT FIT: {r.name}" + (f" ({r.error})" if r.error else ""))
  if advice:
    print("What to change:\n" + "\n".join(advice))
  if failed:
    raise SystemExit(1)


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", None, "Training config file (see configs/).", lock_config=True)
  flags.DEFINE_string("topology", "", 'TPU topology to compile for, e.g. "v5p:4x4x4"; "" = the local devices.')
  flags.DEFINE_list(
    "programs", ["train", "decode"], "Programs to compile: train, decode, grpo (a GRPO step's rollout and update)."
  )
  flags.DEFINE_list("decode_batch", ["1", "32"], "Decode batch sizes to compile.")
  flags.DEFINE_integer("decode_prompt_length", 512, "Prompt bucket of the decode programs.")
  flags.DEFINE_string("decode_mesh", "", 'Decode mesh, e.g. "tensor:4" or "data:1" (one chip); "" = config.mesh.')
  flags.DEFINE_list(
    "remat_policies", [], "Compile the training step once per policy, e.g. full,projections ('': config.model.remat)."
  )
  flags.DEFINE_enum(
    "quantize", None, list(quant.MODES), "Projection kernels (sets config.quantize; the training step needs LoRA)."
  )
  flags.DEFINE_float("hbm_gib", None, "Per-device memory in GiB (overrides the chip table; needed on CPU/GPU).")
  flags.mark_flags_as_required(["config"])
  app.run(main)
