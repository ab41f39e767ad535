"""Training step time of the ReFusion objective against the AR (and MDM) objective on one model and batch.

    python -m refusion_jax.train_bench --config configs/demo.py
    python -m refusion_jax.train_bench --config configs/demo.py --steps 20 --config.batch_size=64

The model, batch size, sequence length and mesh come from the config; the
batch is synthetic (random prompt and answer lengths, random bytes), the same
for every objective. Each objective's step is compiled first (not timed), then
the objectives take `--steps` rounds, one step each per round; the median
step time is reported with the median same-round ratio to AR.
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
from refusion_jax.data.tokenizer import load_tokenizer
from refusion_jax.model.transformer import abstract_model
from refusion_jax.parallel import sharding
from refusion_jax.training import state as train_state
from refusion_jax.training.run_config import model_config_from, objective_config_from


def synthetic_batch(batch_size: int, seq_len: int, pad_id: int, seed: int = 0) -> dict[str, np.ndarray]:
  """tokens [batch, seq_len] of random bytes.

  Each row: a prompt of 1/8..1/4 and an answer of 1/4..1/2 of seq_len, then padding.
  """
  rng = np.random.default_rng(seed)
  prompt_len = rng.integers(seq_len // 8, seq_len // 4 + 1, batch_size)
  answer_len = rng.integers(seq_len // 4, seq_len // 2 + 1, batch_size)
  tokens = rng.integers(0, 256, (batch_size, seq_len))
  tokens[np.arange(seq_len)[None] >= (prompt_len + answer_len)[:, None]] = pad_id
  return dict(
    tokens=tokens.astype(np.int32), prompt_len=prompt_len.astype(np.int32), answer_len=answer_len.astype(np.int32)
  )


def time_objectives(config: ml_collections.ConfigDict, objectives: list[str], steps: int) -> dict[str, list[float]]:
  """Seconds of each training step, per objective kind.

  The objectives take turns, one step each per round, so that a shared
  machine's slow spells fall on all of them alike.
  """
  model_config = model_config_from(config, load_tokenizer(config.tokenizer))
  tx, schedule = train_state.make_optimizer(config.optimizer, total_steps=1000)
  mesh = sharding.make_mesh(dict(config.mesh))
  init = train_state.init_state_fn(model_config, tx, config.seed)
  placement = train_state.make_placement(init, mesh, config.sharding_rules)
  graphdef, _ = abstract_model(model_config)
  batch = placement.batch(synthetic_batch(config.batch_size, config.data.seq_len, model_config.pad_token_id))
  steps_of, states = {}, {}
  for kind in objectives:
    objective = dataclasses.replace(objective_config_from(config, model_config), kind=kind)
    steps_of[kind] = placement.jit_step(
      train_state.make_train_step(graphdef, tx, schedule, objective, config.grad_accum_steps)
    )
    states[kind], metrics = steps_of[kind](jax.jit(init, out_shardings=placement.state_shardings)(), batch)  # compile
    jax.block_until_ready(metrics)
  times = {kind: [] for kind in objectives}
  for _ in range(steps):
    for kind in objectives:
      start = time.perf_counter()
      states[kind], metrics = steps_of[kind](states[kind], batch)
      jax.block_until_ready(metrics)
      times[kind].append(time.perf_counter() - start)
  return times


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  status = report_errors(lambda: report(flags.FLAGS.config, flags.FLAGS.objectives, flags.FLAGS.steps))
  if status:
    sys.exit(status)


def report(config: ml_collections.ConfigDict, objectives: list[str], steps: int) -> None:
  """Time the objectives' steps and print one line per objective with its ratio to the first."""
  times = time_objectives(config, objectives, steps)
  reference = objectives[0]
  print(
    f"batch {config.batch_size} x {config.data.seq_len} tokens, model {dict(config.model)}, "
    f"{jax.device_count()} {jax.devices()[0].platform} device(s), {steps} interleaved rounds"
  )
  for kind, seconds in times.items():
    # The ratio is the median over rounds of same-round ratios, steadier than a ratio of medians.
    ratio = statistics.median(s / r for s, r in zip(seconds, times[reference]))
    print(f"{kind:>9}: {statistics.median(seconds) * 1e3:8.1f} ms/step (median)   x{ratio:.2f} vs {reference}")


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", None, "Training config file (see configs/).", lock_config=True)
  flags.DEFINE_integer("steps", 10, "Timed steps per objective.")
  flags.DEFINE_list("objectives", ["ar", "refusion", "mdm"], "Objectives to time; ratios are to the first.")
  flags.mark_flags_as_required(["config"])
  app.run(main)
