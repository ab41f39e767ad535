"""Training step time, real tokens per second per chip and MFU of the ReFusion, AR and MDM objectives.

    python -m refusion_jax.train_bench --config configs/demo.py
    python -m refusion_jax.train_bench --config configs/refusion_qwen3_8b.py --config.model.num_layers=8 \\
        --config.batch_size=8 --objectives=ar,refusion
    python -m refusion_jax.train_bench --config configs/demo.py --objectives=refusion --lora_ranks=0,8

The model, batch size, sequence length, packing and mesh come from the
config (a config without a tokenizer, like the recipe's, whose tokenizer
comes from `init_from`, is timed on byte tokens). The batch is synthetic,
random bytes in the layout training feeds: with `config.data.packing`, rows
packed with examples of 40-1280 tokens (a prompt of 32-256 and an answer of
8-1024 tokens, about the released training records' range) until the next
one does not fit; without, one example per row of 3/8-3/4 of seq_len. MDM
cannot pack (docs/method.md §1), so it gets the unpacked batch. Each
objective's step is compiled first (not timed), then the objectives take
`--steps` rounds, one step each per round, so that a shared machine's slow
spells fall on all alike. Per objective it prints the median step time, its
median same-round ratio to the first objective, the pad fraction, and per
chip: real (example) tokens per second, model TFLOP/s and MFU against the
chip's bf16 peak (`parallel/compiled.py`; "n/a" where the peak is unknown,
e.g. on CPU). Model FLOPs count real tokens only (model/flops.py).

`--lora_ranks=0,8` times every objective once per rank: full fine-tuning (0)
against LoRA adapters of that rank on `config.lora.targets` (only the adapters
train; their FLOPs count no weight gradient of a frozen kernel). Each row also
prints the memory of its step: the train state (parameters and optimizer
state) and the compiler's temporaries.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from refusion_jax.cli import report_errors
from refusion_jax.data.pipeline import pad_fraction
from refusion_jax.data.tokenizer import load_tokenizer
from refusion_jax.model import flops, lora
from refusion_jax.parallel import compiled, sharding
from refusion_jax.training import state as train_state
from refusion_jax.training.run_config import lora_config_from, model_config_from, objective_config_from


def synthetic_batch(
  batch_size: int, seq_len: int, pad_id: int, *, packing: bool = False, max_segments: int = 16, seed: int = 0
) -> dict[str, np.ndarray]:
  """Random bytes in the training batch layout (data/pipeline.py): tokens [batch, seq_len], and
  prompt_len, answer_len [batch, max_segments] with `packing` (examples back to back), else [batch]."""
  rng = np.random.default_rng(seed)
  if not packing:
    prompt_len = rng.integers(seq_len // 8, seq_len // 4 + 1, batch_size)
    answer_len = rng.integers(seq_len // 4, seq_len // 2 + 1, batch_size)
  else:
    prompt_len = np.zeros((batch_size, max_segments), np.int64)
    answer_len = np.zeros((batch_size, max_segments), np.int64)
    for row in range(batch_size):
      used = 0
      for segment in range(max_segments):
        prompt, answer = rng.integers(32, 257), rng.integers(8, 1025)
        prompt, answer = min(prompt, seq_len // 4), min(answer, seq_len - seq_len // 4)  # short rows still fit one
        if used + prompt + answer > seq_len:
          break
        prompt_len[row, segment], answer_len[row, segment] = prompt, answer
        used += prompt + answer
  tokens = rng.integers(0, 256, (batch_size, seq_len))
  real = np.sum(prompt_len.reshape(batch_size, -1) + answer_len.reshape(batch_size, -1), axis=1)
  tokens[np.arange(seq_len)[None] >= real[:, None]] = pad_id
  return dict(
    tokens=tokens.astype(np.int32), prompt_len=prompt_len.astype(np.int32), answer_len=answer_len.astype(np.int32)
  )


@dataclasses.dataclass
class Timing:
  """One objective's timed steps on its batch."""

  seconds: list[float]
  tokens: int  # real (example) tokens per step
  model_flops: float  # per step (model/flops.py)
  pad_fraction: float
  state_bytes: int = 0  # parameters and optimizer state
  temp_bytes: int | None = None  # the compiled step's temporaries (None where the backend does not say)


def time_objectives(
  config: ml_collections.ConfigDict, objectives: list[str], steps: int, lora_ranks: Sequence[int] = ()
) -> dict[str, Timing]:
  """Each objective's step times (per LoRA rank, "refusion+lora8"), in interleaved rounds, on the batch training
  would feed it."""
  model_config = model_config_from(config, load_tokenizer(config.tokenizer or "bytes"))
  tx, schedule = train_state.make_optimizer(config.optimizer, total_steps=1000)
  mesh = sharding.make_mesh(dict(config.mesh))
  configured = lora_config_from(config)
  settings = [dataclasses.replace(configured, rank=rank) for rank in lora_ranks] or [configured]
  steps_of, states, batches, timings = {}, {}, {}, {}
  for kind, lora_config in ((k, s) for k in objectives for s in settings):
    init = train_state.init_state_fn(model_config, tx, config.seed, lora_config)
    placement = train_state.make_placement(init, mesh, config.sharding_rules)
    graphdef, _ = lora.abstract_lora_model(model_config, lora_config)
    objective = dataclasses.replace(objective_config_from(config, model_config), kind=kind)
    kind_name = kind
    kind = kind + (f"+lora{lora_config.rank}" if lora_config.enabled else "")
    packing = config.data.packing and kind_name != "mdm"
    host_batch = synthetic_batch(
      config.batch_size,
      config.data.seq_len,
      model_config.pad_token_id,
      packing=packing,
      max_segments=config.data.max_segments,
    )
    lengths = flops.example_lengths(host_batch)
    timings[kind] = Timing(
      seconds=[],
      tokens=int(lengths.sum()),
      model_flops=flops.training_flops(model_config, lengths, kind_name != "mdm", lora_config),
      pad_fraction=pad_fraction(host_batch),
    )
    batches[kind] = placement.batch(host_batch)
    step = placement.jit_step(train_state.make_train_step(graphdef, tx, schedule, objective, config.grad_accum_steps))
    state = jax.jit(init, out_shardings=placement.state_shardings)()
    timings[kind].state_bytes = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(state))
    steps_of[kind] = step.lower(state, batches[kind]).compile()
    timings[kind].temp_bytes = getattr(steps_of[kind].memory_analysis(), "temp_size_in_bytes", None)
    states[kind], metrics = steps_of[kind](state, batches[kind])  # the first run (not timed)
    jax.block_until_ready(metrics)
  for _ in range(steps):
    for kind in steps_of:
      start = time.perf_counter()
      states[kind], metrics = steps_of[kind](states[kind], batches[kind])
      jax.block_until_ready(metrics)
      timings[kind].seconds.append(time.perf_counter() - start)
  return timings


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
  timings = time_objectives(config, objectives, steps, lora_ranks)
  device = jax.devices()[0]
  peak = compiled.peak_flops(device)
  model_config = model_config_from(config, load_tokenizer(config.tokenizer or "bytes"))
  print(
    f"batch {config.batch_size} x {config.data.seq_len} tokens, packing {config.data.packing}, "
    f"{model_config.num_layers} layers of hidden {model_config.hidden_size}, vocab {model_config.vocab_size}, "
    f"{model_config.dtype} compute, remat {model_config.remat}, attention {model_config.attention_impl}; "
    f"{jax.device_count()} x {device.device_kind} "
    f"(peak {'unknown' if peak is None else f'{peak / 1e12:.0f} TFLOP/s bf16'}), {steps} interleaved rounds"
  )
  first = next(iter(timings))
  reference = timings[first].seconds
  for kind, timing in timings.items():
    # The ratio is the median over rounds of same-round ratios, steadier than a ratio of medians.
    ratio = statistics.median(s / r for s, r in zip(timing.seconds, reference))
    seconds = statistics.median(timing.seconds)
    chip = flops.per_chip(timing.model_flops, timing.tokens, seconds, jax.device_count(), peak)
    mfu = f"{chip['mfu']:.1%}" if "mfu" in chip else "n/a"
    temps = "n/a" if timing.temp_bytes is None else f"{timing.temp_bytes / 1e6:,.1f} MB"
    print(
      f"{kind:>9}: {seconds * 1e3:8.1f} ms/step (median)  x{ratio:.2f} vs {first}  "
      f"pad {timing.pad_fraction:.2f}  {chip['tokens_per_second_per_chip']:,.0f} real tokens/s/chip  "
      f"{chip['model_tflops_per_chip']:.1f} TFLOP/s/chip  MFU {mfu}  "
      f"state {timing.state_bytes / 1e6:,.2f} MB  temporaries {temps}"
    )


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", None, "Training config file (see configs/).", lock_config=True)
  flags.DEFINE_integer("steps", 10, "Timed steps per objective.")
  flags.DEFINE_list("objectives", ["ar", "refusion", "mdm"], "Objectives to time; ratios are to the first.")
  flags.DEFINE_list("lora_ranks", [], "Time each objective per LoRA rank (0: full fine-tuning); '': config.lora.")
  flags.mark_flags_as_required(["config"])
  app.run(main)
