"""The cost of decoding with LoRA adapters unmerged against merged, measured in one run (results/lora.md).

Same model, same prompts, same tokens (checked): ReFusion decoding of a
batch of prompts with rank-`rank` adapters on q/k/v/o kept apart (one more
pair of small contractions per adapted kernel and forward) and folded into
the kernels (`merge_lora`), timed by `benchmarks.timer`: a warm-up decode each
(compilation excluded), then `repeats` interleaved rounds; the ratio is the
median of same-round ratios.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx

from refusion_jax.benchmarks.timer import Timing, machine, time_rounds
from refusion_jax.decoding.engine import decode
from refusion_jax.decoding.refusion import ReFusion
from refusion_jax.model import lora
from refusion_jax.model.config import preset
from refusion_jax.model.transformer import init_model


@dataclasses.dataclass(frozen=True)
class LoraCostOptions:
  """The model, adapters, prompts and rounds of the measurement."""

  preset: str = "small"
  rank: int = 8
  batch: int = 16
  gen_length: int = 64
  repeats: int = 5  # timed rounds after the warm-up (benchmarks.timer)


@dataclasses.dataclass
class LoraCost:
  """Each variant's timing, and the forwards a decode ran."""

  options: LoraCostOptions
  timings: dict[str, Timing]
  forwards: int

  @property
  def ratio(self) -> float:
    """Unmerged over merged: the median of same-round ratios."""
    return self.timings["unmerged"].ratio_to(self.timings["merged"])

  def format(self) -> str:
    o = self.options
    lines = [
      f"machine: {machine()}",
      f"{o.preset}, rank {o.rank} on q/k/v/o, {o.batch} prompts, G={o.gen_length}, {self.forwards} forwards:",
    ]
    lines += [
      f"  {name:9s} {t.median:.3f} s (median of {o.repeats} rounds, spread {100 * t.spread:.0f}%)"
      for name, t in self.timings.items()
    ]
    lines.append(f"  unmerged / merged = {self.ratio:.3f} (median of same-round ratios; same tokens)")
    return "\n".join(lines)


def run_lora_cost(options: LoraCostOptions) -> LoraCost:
  """Decode the same prompts unmerged and merged, interleaved; raises if their tokens differ."""
  config = preset(options.preset, vocab_size=512, mask_token_id=511, eos_token_id=510, pad_token_id=0)
  model = lora.add_lora(init_model(config, seed=0), lora.LoraConfig(rank=options.rank))
  graphdef, state = nnx.split(model)

  def noise(path, x):  # trained adapters are not zero: B random too
    return 0.05 * jax.random.normal(jax.random.PRNGKey(len(path)), x.shape) if lora.is_adapter(path) else x

  model = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(noise, state))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 500, int(rng.integers(16, 48))).tolist() for _ in range(options.batch)]
  method = ReFusion(options.gen_length, slot_size=8, serial_blocks=1, slot_threshold=0.5, token_threshold=0.3)
  candidates = {"unmerged": model, "merged": lora.merge_lora(model)}
  calls = {name: functools.partial(decode, candidate, prompts, method) for name, candidate in candidates.items()}
  results, timings = time_rounds(calls, options.repeats)
  if results["unmerged"].tokens != results["merged"].tokens:
    raise AssertionError("merged and unmerged decoding disagree")
  return LoraCost(options=options, timings=timings, forwards=int(np.max(results["merged"].num_forwards)))
