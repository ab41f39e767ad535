"""The cost of decoding with LoRA adapters unmerged against merged, measured in one run (results/lora.md).

Same model, same prompts, same tokens (checked): ReFusion decoding of a
batch of prompts with rank-`rank` adapters on q/k/v/o kept apart (one more
pair of small contractions per adapted kernel and forward) and folded into
the kernels (`merge_lora`). Each is compiled once, then the two take
`repeats` rounds, one run each per round; the ratio is the median of
same-round ratios.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import numpy as np
from flax import nnx

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
  repeats: int = 5


@dataclasses.dataclass
class LoraCost:
  """Median seconds of each variant over the rounds, the median same-round ratio, and the forwards run."""

  options: LoraCostOptions
  seconds: dict[str, float]
  ratio: float
  forwards: int

  def format(self) -> str:
    o = self.options
    lines = [f"{o.preset}, rank {o.rank} on q/k/v/o, {o.batch} prompts, G={o.gen_length}, {self.forwards} forwards:"]
    lines += [f"  {name:9s} {s:.3f} s (median of {o.repeats})" for name, s in self.seconds.items()]
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
  results = {name: decode(candidate, prompts, method) for name, candidate in candidates.items()}  # compiles
  seconds = {name: [] for name in candidates}
  for _ in range(options.repeats):  # interleaved, so that a shared machine's slow spells fall on both alike
    for name, candidate in candidates.items():
      start = time.perf_counter()
      decode(candidate, prompts, method)
      seconds[name].append(time.perf_counter() - start)
  if results["unmerged"].tokens != results["merged"].tokens:
    raise AssertionError("merged and unmerged decoding disagree")
  return LoraCost(
    options=options,
    seconds={name: statistics.median(runs) for name, runs in seconds.items()},
    ratio=statistics.median(u / m for u, m in zip(seconds["unmerged"], seconds["merged"])),
    forwards=int(np.max(results["merged"].num_forwards)),
  )
