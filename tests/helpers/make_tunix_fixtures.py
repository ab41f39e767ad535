"""Regenerate tests/fixtures/tunix: real tunix checkpoints of tiny Qwen3, Qwen2 and Llama 3 models with tunix's logits.

CI cannot import tunix, so the checkpoint tests read what this script commits.
It needs google-tunix 0.1.7, installed without its (heavy) dependencies:

    pip download --no-deps google-tunix jaxtyping wadler_lindig google-metrax clu sentencepiece perfetto pandas -d W
    pip install --no-deps --target /tmp/tunix_site W/*.whl     # nothing of jax / flax / orbax is touched
    PYTHONPATH=/tmp/tunix_site:. python tests/helpers/make_tunix_fixtures.py

For each family, `<family>/` holds the checkpoint exactly as
`tunix.sft.checkpoint_manager.CheckpointManager.save` writes it
(`<step>/model_params`), `reference.npz` (random tokens, positions and the
logits tunix's own forward computes from them) and `fixture.json` (the
`ModelConfig` that reproduces tunix's forward: tunix's Qwen3 and Llama 3 use
RoPE theta 1e6 whatever their config says). `lora/` is a LoRA-only save
(`save_only_lora_params=True`) of the Qwen3 model.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.models.llama3 import model as llama3
from tunix.models.qwen2 import model as qwen2
from tunix.models.qwen3 import model as qwen3
from tunix.sft.checkpoint_manager import CheckpointManager

from refusion_jax.model.config import ModelConfig, family_switches

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_default_matmul_precision", "highest")

OUT = pathlib.Path(__file__).parents[1] / "fixtures" / "tunix"
STEP = 3
# Small enough for a few tens of KB per checkpoint, divisible by 2 for the 8-device mesh tests.
SHAPE = dict(num_layers=2, vocab_size=48, embed_dim=16, hidden_dim=32, num_heads=4, head_dim=8, num_kv_heads=2)

# family: (tunix module, model class, tied head, RoPE theta tunix applies, RoPE theta in tunix's config)
FAMILIES = {
  "qwen3": (qwen3, qwen3.Qwen3, False, 1_000_000.0, 1_000_000),
  "qwen2": (qwen2, qwen2.Qwen2, True, 10_000.0, 10_000),
  "llama": (llama3, llama3.Llama3, False, 1_000_000.0, 500_000),
}


def _randomise(model: nnx.Module, key: jax.Array) -> None:
  """Random values everywhere: tunix initialises MLPs to zero and norms to one, which would hide swaps."""
  state = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(key, len(leaves))
  noisy = [0.3 * jax.random.normal(k, x.shape, x.dtype) + (x if x.ndim == 1 else 0) for k, x in zip(keys, leaves)]
  nnx.update(model, jax.tree.unflatten(treedef, noisy))


def _reference(model: nnx.Module, seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  batch, length = 2, 7
  tokens = rng.integers(0, SHAPE["vocab_size"], (batch, length)).astype(np.int32)
  positions = (rng.integers(0, 500, (batch, 1)) + np.arange(length)).astype(np.int32)
  mask = np.broadcast_to(np.tril(np.ones((length, length), bool)), (batch, length, length))
  logits, _ = model(jnp.asarray(tokens), jnp.asarray(positions), None, jnp.asarray(mask))
  return dict(tokens=tokens, positions=positions, logits=np.asarray(logits, np.float32))


def _our_config(family: str, tied: bool, theta: float, norm_eps: float) -> dict:
  config = ModelConfig(
    vocab_size=SHAPE["vocab_size"],
    hidden_size=SHAPE["embed_dim"],
    intermediate_size=SHAPE["hidden_dim"],
    num_layers=SHAPE["num_layers"],
    num_heads=SHAPE["num_heads"],
    num_kv_heads=SHAPE["num_kv_heads"],
    head_dim=SHAPE["head_dim"],
    architecture=family,
    tie_embeddings=tied,
    rope_theta=theta,
    rms_norm_eps=norm_eps,
    **family_switches(family),
  )
  return dataclasses.asdict(config)


def _save(model: nnx.Module, directory: pathlib.Path, lora_only: bool = False) -> None:
  manager = CheckpointManager(str(directory))
  assert manager.save(STEP, model, save_only_lora_params=lora_only, force=True)
  manager.close()


def _add_lora(model: nnx.Module, key: jax.Array, rank: int = 2) -> None:
  """Adapters named as tunix's LoRA (qwix) names them: `<param>_lora_a` / `_lora_b` beside each kernel."""
  for layer in model.layers:
    for proj in (layer.attn.q_proj, layer.attn.v_proj):
      key, a_key, b_key = jax.random.split(key, 3)
      embed = proj.w.shape[0]
      proj.w_lora_a = nnx.LoRAParam(jax.random.normal(a_key, (embed, rank)))
      proj.w_lora_b = nnx.LoRAParam(jax.random.normal(b_key, (rank, *proj.w.shape[1:])))


def main() -> None:
  shutil.rmtree(OUT, ignore_errors=True)
  for seed, (family, (module, model_class, tied, theta, config_theta)) in enumerate(FAMILIES.items()):
    tie_field = "weight_tying" if family == "llama" else "use_tied_embedding"  # tunix's Llama 3 names it so
    tunix_config = module.ModelConfig(**SHAPE, rope_theta=config_theta, norm_eps=1e-6, **{tie_field: tied})
    model = model_class(tunix_config, rngs=nnx.Rngs(seed))
    _randomise(model, jax.random.PRNGKey(100 + seed))
    directory = OUT / family
    _save(model, directory)
    np.savez(directory / "reference.npz", **_reference(model, seed))
    fixture = dict(family=family, step=STEP, model_config=_our_config(family, tied, theta, 1e-6))
    (directory / "fixture.json").write_text(json.dumps(fixture, indent=2) + "\n")
    if family == "qwen3":
      _add_lora(model, jax.random.PRNGKey(7))
      _save(model, OUT / "lora", lora_only=True)
  total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
  print(f"wrote {OUT} ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
  main()
