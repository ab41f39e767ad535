"""Peak host memory of loading a checkpoint, measured in a fresh process.

    python tests/helpers/memory_probe.py write hf|tunix|tunix-real DIR HIDDEN VOCAB LAYERS   # a synthetic float32 Qwen3
    python tests/helpers/memory_probe.py load DIR          # prints JSON: peak growth, model bytes, largest array

    # ~1 GB (1.02e9 bytes, largest array the 131 MB embedding): hidden 1024, vocab 32000, 12 layers
    python tests/helpers/memory_probe.py write hf /tmp/hf1g 1024 32000 12
    python tests/helpers/memory_probe.py load /tmp/hf1g

`load` resets the kernel's peak-RSS mark (`/proc/self/clear_refs`) once
everything is imported and JAX is up, loads the checkpoint (onto the one CPU
device, i.e. into host memory) and reports how far the peak grew above the
resident size before. The model itself is part of that growth; the loader's
promise is that the rest stays under twice the largest array.

`write tunix` writes the tree tunix's checkpoint manager writes without
needing tunix (tests/helpers/tunix_layout.py); `write tunix-real` has tunix write it
(PYTHONPATH=<tunix site>:. as in tests/helpers/make_tunix_fixtures.py).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling test helpers

import jax
import jax.numpy as jnp

jax.config.update("jax_platforms", "cpu")


def synthetic_config(hidden: int, vocab: int, layers: int):
  """A Qwen3-shaped float32 config: head_dim 64, GQA 2, SwiGLU 4 × hidden."""
  from refusion_jax.model.config import ModelConfig

  return ModelConfig(
    vocab_size=vocab,
    hidden_size=hidden,
    intermediate_size=4 * hidden,
    num_layers=layers,
    num_heads=hidden // 64,
    num_kv_heads=hidden // 128,
    head_dim=64,
  )


def _write_with_tunix(directory: str, config) -> None:
  """tunix's own model and checkpoint manager (needs tunix, see tests/helpers/make_tunix_fixtures.py)."""
  from flax import nnx
  from tunix.models.qwen3 import model as qwen3
  from tunix.sft.checkpoint_manager import CheckpointManager

  tunix_config = qwen3.ModelConfig(
    num_layers=config.num_layers,
    vocab_size=config.vocab_size,
    embed_dim=config.hidden_size,
    hidden_dim=config.intermediate_size,
    num_heads=config.num_heads,
    head_dim=config.head_dim,
    num_kv_heads=config.num_kv_heads,
    rope_theta=1_000_000,
    norm_eps=config.rms_norm_eps,
  )
  manager = CheckpointManager(directory)
  manager.save(1, qwen3.Qwen3(tunix_config, rngs=nnx.Rngs(0)), force=True)
  manager.close()


def write(fmt: str, directory: str, hidden: int, vocab: int, layers: int) -> None:
  """`fmt`: "hf", "tunix" (tunix's tree, written without tunix) or "tunix-real" (written by tunix itself)."""
  from refusion_jax.checkpoints.hf import save_hf
  from refusion_jax.model.transformer import init_model

  config = synthetic_config(hidden, vocab, layers)
  if fmt == "tunix-real":
    _write_with_tunix(directory, config)
  elif fmt == "hf":
    save_hf(init_model(config), directory)
  else:
    from tunix_layout import save_tunix_layout

    save_tunix_layout(init_model(config), directory)
  (__import__("pathlib").Path(directory) / "probe_config.json").write_text(json.dumps(config.__dict__))


def _status(field: str) -> int:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def load(directory: str) -> dict:
  from flax import nnx

  from refusion_jax.checkpoints.load import load_model
  from refusion_jax.model.config import ModelConfig

  config = ModelConfig(**json.loads((__import__("pathlib").Path(directory) / "probe_config.json").read_text()))
  jnp.zeros(1).block_until_ready()
  before = _status("VmRSS")
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current resident size
  model = load_model(directory, config=config)
  arrays = [variable.get_value() for _, variable in nnx.to_flat_state(nnx.state(model))]
  jax.block_until_ready(arrays)
  peak = _status("VmHWM")
  return dict(
    growth=peak - before,
    model_bytes=sum(a.nbytes for a in arrays),
    largest_bytes=max(a.nbytes for a in arrays),
    rss_before=before,
  )


if __name__ == "__main__":
  if sys.argv[1] == "write":
    write(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7]))
  else:
    print(json.dumps(load(sys.argv[2])))
