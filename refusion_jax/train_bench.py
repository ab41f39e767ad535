"""Training step time, real tokens per second per chip and MFU of the ReFusion, AR and MDM objectives.

    python -m refusion_jax.train_bench --config configs/demo.py
    python -m refusion_jax.train_bench --config configs/refusion_qwen3_8b.py --config.model.num_layers=8 \\
        --config.batch_size=8 --objectives=ar,refusion
    python -m refusion_jax.train_bench --config configs/demo.py --objectives=refusion --lora_ranks=0,8

The model, batch size, sequence length, packing and mesh come from the
config (a config without a tokenizer, like the recipe's, whose tokenizer
comes from `init_from`, is timed on byte tokens); the synthetic batches are
`refusion_jax.benchmarks.train_step`'s, the warm-up step and the interleaved
rounds `refusion_jax.benchmarks.timer`'s (`--steps` rounds). Per objective it
prints the median step time and the rounds' spread, its median same-round
ratio to the first objective, the pad fraction, and per chip: real (example) tokens per
second, model TFLOP/s and MFU against the chip's bf16 peak
(`parallel/compiled.py`; "n/a" where the peak is unknown, e.g. on CPU). Model
FLOPs count real tokens only (model/flops.py).

`--lora_ranks=0,8` times every objective once per rank: full fine-tuning (0)
against LoRA adapters of that rank on `config.lora.targets` (only the adapters
train; their FLOPs count no weight gradient of a frozen kernel). Each row also
prints the memory of its step: the train state (parameters and optimizer
state) and the compiler's temporaries.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import jax
import ml_collections
from absl import app, flags
from ml_collections import config_flags

from refusion_jax.benchmarks.timer import machine
from refusion_jax.benchmarks.train_step import time_objectives
from refusion_jax.cli import report_errors
from refusion_jax.data.tokenizer import load_tokenizer
from refusion_jax.model import flops
from refusion_jax.parallel import compiled
from refusion_jax.training.run_config import model_config_from


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  ranks = [int(rank) for rank in flags.FLAGS.lora_ranks]
  status = report_errors(lambda: report(flags.FLAGS.config, flags.FLAGS.objectives, flags.FLAGS.steps, ranks))
  if status:
    sys.exit(status)


def report(
  config: ml_collections.ConfigDict, objectives: list[str], steps: int, lora_ranks: Sequence[int] = ()
) -> None:
  """Time the objectives' steps and print one line per objective (and LoRA rank): time, ratio to the first,
  per-chip throughput, memory."""
  measured = time_objectives(config, objectives, steps, lora_ranks)
  peak = compiled.peak_flops(jax.devices()[0])
  model_config = model_config_from(config, load_tokenizer(config.tokenizer or "bytes"))
  print(
    f"batch {config.batch_size} x {config.data.seq_len} tokens, packing {config.data.packing}, "
    f"{model_config.num_layers} layers of hidden {model_config.hidden_size}, vocab {model_config.vocab_size}, "
    f"{model_config.dtype} compute, remat {model_config.remat}, attention {model_config.attention_impl}; "
    f"machine: {machine()} (peak {'unknown' if peak is None else f'{peak / 1e12:.0f} TFLOP/s bf16'}), "
    f"{steps} interleaved rounds after a warm-up step"
  )
  first = next(iter(measured))
  for kind, step in measured.items():
    seconds = step.timing.median
    chip = flops.per_chip(step.model_flops, step.tokens, seconds, jax.device_count(), peak)
    mfu = f"{chip['mfu']:.1%}" if "mfu" in chip else "n/a"
    temps = "n/a" if step.temp_bytes is None else f"{step.temp_bytes / 1e6:,.1f} MB"
    print(
      f"{kind:>9}: {seconds * 1e3:8.1f} ms/step (median, spread {100 * step.timing.spread:.0f}%)  "
      f"x{step.timing.ratio_to(measured[first].timing):.2f} vs {first}  "
      f"pad {step.pad_fraction:.2f}  {chip['tokens_per_second_per_chip']:,.0f} real tokens/s/chip  "
      f"{chip['model_tflops_per_chip']:.1f} TFLOP/s/chip  MFU {mfu}  "
      f"state {step.state_bytes / 1e6:,.2f} MB  temporaries {temps}"
    )


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", None, "Training config file (see configs/).", lock_config=True)
  flags.DEFINE_integer("steps", 10, "Timed rounds (one step per objective each) after the warm-up step.")
  flags.DEFINE_list("objectives", ["ar", "refusion", "mdm"], "Objectives to time; ratios are to the first.")
  flags.DEFINE_list("lora_ranks", [], "Time each objective per LoRA rank (0: full fine-tuning); '': config.lora.")
  flags.mark_flags_as_required(["config"])
  app.run(main)
