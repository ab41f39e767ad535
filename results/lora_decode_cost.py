"""The cost of decoding with LoRA adapters unmerged against merged, measured in one run (results/lora.md).

    JAX_PLATFORMS=cpu python results/lora_decode_cost.py [--preset small] [--rank 8] [--batch 16]

Same model, same prompts, same tokens (checked): ReFusion decoding of `--batch` prompts with rank-`--rank`
adapters on q/k/v/o kept apart (one more pair of small contractions per adapted kernel and forward) and
folded into the kernels (`merge_lora`). Each is compiled once, then the two take `--repeats` rounds, one run each per
round; the ratio is the median of same-round ratios.
"""

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx

from refusion_jax.decoding.refusion import generate
from refusion_jax.model import lora
from refusion_jax.model.config import preset
from refusion_jax.model.transformer import init_model


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="small")
  parser.add_argument("--rank", type=int, default=8)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--gen_length", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  config = preset(args.preset, vocab_size=512, mask_token_id=511, eos_token_id=510, pad_token_id=0)
  model = lora.add_lora(init_model(config, seed=0), lora.LoraConfig(rank=args.rank))
  graphdef, state = nnx.split(model)

  def noise(path, x):  # trained adapters are not zero: B random too
    return 0.05 * jax.random.normal(jax.random.PRNGKey(len(path)), x.shape) if lora.is_adapter(path) else x

  model = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(noise, state))
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(1, 500, int(rng.integers(16, 48)))) for _ in range(args.batch)]
  knobs = dict(gen_length=args.gen_length, slot_size=8, serial_blocks=1, slot_threshold=0.5, token_threshold=0.3)
  candidates = {"unmerged": model, "merged": lora.merge_lora(model)}
  results = {name: generate(candidate, prompts, **knobs) for name, candidate in candidates.items()}  # compiles
  seconds = {name: [] for name in candidates}
  for _ in range(args.repeats):  # interleaved, so that a shared machine's slow spells fall on both alike
    for name, candidate in candidates.items():
      start = time.perf_counter()
      generate(candidate, prompts, **knobs)
      seconds[name].append(time.perf_counter() - start)
  assert results["unmerged"].tokens == results["merged"].tokens, "merged and unmerged decoding disagree"
  forwards = int(np.max(results["merged"].num_forwards))
  print(f"{args.preset}, rank {args.rank} on q/k/v/o, {args.batch} prompts, G={args.gen_length}, {forwards} forwards:")
  for name, runs in seconds.items():
    print(f"  {name:9s} {statistics.median(runs):.3f} s (median of {len(runs)})")
  ratio = statistics.median(u / m for u, m in zip(seconds["unmerged"], seconds["merged"]))
  print(f"  unmerged / merged = {ratio:.3f} (median of same-round ratios; same tokens)")


if __name__ == "__main__":
  main()
