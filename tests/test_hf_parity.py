"""Logits of a loaded checkpoint match transformers' own model in float32."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers.closeness import assert_logits_close, relative_error
from helpers.hf_utils import hf_logits, save_tiny_hf_model

from refusion_jax.checkpoints.load import load_model

TOLERANCE = 1e-4

# Each case: family, Hugging Face config fields. Head counts cover GQA ratios
# 3, 1 (odd head count) and 3 with a single KV head; vocabularies are not
# multiples of 128 (151,671 is ReFusion's).
CASES = {
  "qwen3_gqa3_headdim16_theta1e6": (
    "qwen3",
    dict(num_attention_heads=6, num_key_value_heads=2, head_dim=16, hidden_size=48, rope_theta=1e6),
  ),
  "qwen3_mha5_tied_linear_rope": (
    "qwen3",
    dict(
      num_attention_heads=5,
      num_key_value_heads=5,
      head_dim=8,
      hidden_size=40,
      tie_word_embeddings=True,
      rope_scaling={"type": "linear", "factor": 2.5},
    ),
  ),
  "qwen3_mqa3_headdim32": ("qwen3", dict(num_attention_heads=3, num_key_value_heads=1, head_dim=32, hidden_size=48)),
  "qwen3_refusion_vocab": (
    "qwen3",
    dict(
      vocab_size=151_671,
      hidden_size=16,
      intermediate_size=24,
      num_hidden_layers=1,
      num_attention_heads=2,
      num_key_value_heads=1,
      head_dim=16,
      rope_theta=1e6,
    ),
  ),
  "qwen2_gqa3_tied_theta1e6": (
    "qwen2",
    dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=48, tie_word_embeddings=True, rope_theta=1e6),
  ),
  "qwen2_mha5_linear_rope": (
    "qwen2",
    dict(num_attention_heads=5, num_key_value_heads=5, hidden_size=40, rope_scaling={"type": "linear", "factor": 2.0}),
  ),
  "qwen2_mqa3": ("qwen2", dict(num_attention_heads=3, num_key_value_heads=1, hidden_size=48)),
  "llama_gqa3_theta1e6": ("llama", dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=48, rope_theta=1e6)),
  "llama_mha5_tied": (
    "llama",
    dict(num_attention_heads=5, num_key_value_heads=5, hidden_size=40, tie_word_embeddings=True),
  ),
  # Llama 3.1 RoPE: with head_dim 8 and theta 5e5 the wavelengths (6, 170, 4.5e3, 1.2e5 positions) fall
  # in the kept, interpolated and scaled bands of original_max_position_embeddings=512.
  "llama_gqa3_llama3_rope": (
    "llama",
    dict(
      num_attention_heads=6,
      num_key_value_heads=2,
      hidden_size=48,
      rope_theta=500_000.0,
      rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=512
      ),
    ),
  ),
  "llama_mqa3_linear_rope": (
    "llama",
    dict(num_attention_heads=3, num_key_value_heads=1, hidden_size=48, rope_scaling={"type": "linear", "factor": 4.0}),
  ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
  family, fields = CASES[case]
  hf_model = save_tiny_hf_model(tmp_path, family, seed=len(case), **fields)
  model = load_model(tmp_path)

  rng = np.random.default_rng(len(case))
  batch, length = 2, 17
  tokens = rng.integers(0, fields.get("vocab_size", 211), (batch, length))
  # Start each row at a different random offset so RoPE is tested far from 0.
  positions = rng.integers(0, 2000, (batch, 1)) + np.arange(length)

  ours, _ = model(jnp.asarray(tokens), jnp.asarray(positions, jnp.int32))
  reference = hf_logits(hf_model, tokens, positions)
  print(f"\n[hf parity] {case}: max|diff| / max|logit| = {relative_error(ours, reference):.2e}")
  assert_logits_close(ours, reference, TOLERANCE)
