"""The checkpoint tests' shared cases: the committed tunix checkpoints with tunix's logits, and MaxText
checkpoints written in MaxText's layout from tiny Hugging Face models."""

import json
import pathlib

import jax.numpy as jnp
import numpy as np

from helpers.hf_utils import save_tiny_hf_model
from helpers.maxtext_layout import maxtext_params, save_maxtext
from refusion_jax.model.config import ModelConfig

TUNIX = pathlib.Path(__file__).parents[1] / "fixtures" / "tunix"
TOLERANCE = 1e-5  # relative logit error of a checkpoint read against its source project's logits


def tunix_case(family: str) -> tuple[ModelConfig, dict]:
  """The committed tunix checkpoint's config and its reference: tokens, positions and tunix's logits."""
  fixture = json.loads((TUNIX / family / "fixture.json").read_text())
  return ModelConfig(**fixture["model_config"]), dict(np.load(TUNIX / family / "reference.npz"))


def logits(model, tokens, positions=None) -> np.ndarray:
  """The first row's logits [length, vocab] of `model` on tokens [batch, length]."""
  positions = None if positions is None else jnp.asarray(positions, jnp.int32)
  return np.asarray(model(jnp.asarray(tokens), positions)[0])


def random_tokens(vocab=211, shape=(2, 11)) -> np.ndarray:
  return np.random.default_rng().integers(0, vocab, shape)


MAXTEXT_CASES = {
  # family, scanned, padded vocabulary, Hugging Face config fields
  "qwen3_scanned_padded_vocab": ("qwen3", True, 256, dict(head_dim=16)),
  "qwen2_unscanned_tied": ("qwen2", False, None, dict(tie_word_embeddings=True)),
  "llama_scanned_gqa3": ("llama", True, None, dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=48)),
  "llama_unscanned_llama3_rope": (
    "llama",
    False,
    224,
    dict(
      rope_theta=500_000.0,
      rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=256
      ),
    ),
  ),
}


def maxtext_case(tmp_path, case, **writer):
  """A tiny HF model of `case` saved in tmp_path/hf, and its MaxText checkpoint (step 4) in tmp_path/maxtext."""
  family, scanned, padded, fields = MAXTEXT_CASES[case]
  hf_model = save_tiny_hf_model(tmp_path / "hf", family, seed=len(case), **fields)
  save_maxtext(tmp_path / "maxtext", maxtext_params(hf_model, scanned=scanned, padded_vocab=padded, **writer), step=4)
  return hf_model
