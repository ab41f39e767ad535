"""Training step times of the ReFusion, AR and MDM objectives on synthetic batches in the training layout.

The batch is random bytes in the layout training feeds (data/pipeline.py):
with packing, rows packed with examples of 40-1280 tokens (a prompt of 32-256
and an answer of 8-1024 tokens, about the released training records' range)
until the next one does not fit; without, one example per row of 3/8-3/4 of
seq_len. MDM cannot pack (docs/method.md §1), so it gets the unpacked batch.
Each objective's step is compiled first, then timed by `benchmarks.timer`: a
warm-up step each (not counted), then the objectives take turns, one step each
per round. `python -m refusion_jax.train_bench` prints the report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import ml_collections
import numpy as np

from refusion_jax.benchmarks.timer import Timing, time_rounds
from refusion_jax.data.pipeline import pad_fraction
from refusion_jax.data.tokenizer import load_tokenizer
from refusion_jax.model import flops, lora
from refusion_jax.parallel import sharding
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
class ObjectiveStep:
  """One objective's training step on its batch: its timing and what it computes and holds."""

  timing: Timing
  tokens: int  # real (example) tokens per step
  model_flops: float  # per step (model/flops.py)
  pad_fraction: float
  state_bytes: int  # parameters and optimizer state
  temp_bytes: int | None  # the compiled step's temporaries (None where the backend does not say)


def time_objectives(
  config: ml_collections.ConfigDict, objectives: list[str], steps: int, lora_ranks: Sequence[int] = ()
) -> dict[str, ObjectiveStep]:
  """Each objective's step (per LoRA rank, "refusion+lora8") timed in `steps` interleaved rounds
  (`benchmarks.timer`) on the batch training would feed it."""
  model_config = model_config_from(config, load_tokenizer(config.tokenizer or "bytes"))
  tx, schedule = train_state.make_optimizer(config.optimizer, total_steps=1000)
  mesh = sharding.make_mesh(dict(config.mesh))
  configured = lora_config_from(config)
  settings = [dataclasses.replace(configured, rank=rank) for rank in lora_ranks] or [configured]
  steps_of, states, batches, costs = {}, {}, {}, {}
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
    costs[kind] = dict(
      tokens=int(lengths.sum()),
      model_flops=flops.training_flops(model_config, lengths, kind_name != "mdm", lora_config),
      pad_fraction=pad_fraction(host_batch),
    )
    batches[kind] = placement.batch(host_batch)
    step = placement.jit_step(train_state.make_train_step(graphdef, tx, schedule, objective, config.grad_accum_steps))
    state = jax.jit(init, out_shardings=placement.state_shardings)()
    costs[kind]["state_bytes"] = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(state))
    steps_of[kind] = step.lower(state, batches[kind]).compile()
    costs[kind]["temp_bytes"] = getattr(steps_of[kind].memory_analysis(), "temp_size_in_bytes", None)
    states[kind] = state

  def step(kind: str) -> Callable[[], dict]:
    def call() -> dict:  # one step, the state carried to the next; the timer waits for its metrics
      states[kind], metrics = steps_of[kind](states[kind], batches[kind])
      return metrics

    return call

  _, timings = time_rounds({kind: step(kind) for kind in steps_of}, steps)
  return {kind: ObjectiveStep(timing=timings[kind], **costs[kind]) for kind in steps_of}
