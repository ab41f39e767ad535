"""Model FLOPs (refusion_jax.model.flops) against what XLA counts for the same forward."""

import jax
import numpy as np
import pytest

from refusion_jax.model import flops
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import init_model


@pytest.mark.parametrize("length", [16, 48])
def test_forward_flops_match_the_compiled_count(length):
  # The dense path computes every (query, key) pair, so the bidirectional count is what it runs.
  config = tiny(vocab_size=512, num_layers=3, hidden_size=128, intermediate_size=256, num_heads=4, head_dim=32)
  model = init_model(config)
  tokens = np.random.default_rng(length).integers(0, 512, (2, length))
  cost = jax.jit(lambda t: model(t)[0]).lower(tokens).compile().cost_analysis()
  counted = (cost[0] if isinstance(cost, list) else cost)["flops"]
  model_flops = flops.training_flops(config, [length, length], causal=False) / 3  # one forward
  # Norms, RoPE, softmax and the activation are the few percent XLA counts on top.
  assert model_flops <= counted <= 1.06 * model_flops


def test_causal_segments_count_half_the_pairs_and_padding_nothing():
  assert flops.attention_pairs([4], causal=True) == 10 and flops.attention_pairs([4], causal=False) == 16
  config = tiny()
  packed = flops.training_flops(config, [5, 7, 3])
  assert packed == pytest.approx(sum(flops.training_flops(config, [n]) for n in (5, 7, 3)))
  assert flops.training_flops(config, [6]) > 6 * 6 * flops.matmul_weights(config)


def test_batch_lengths_and_per_chip_rates():
  unpacked = {"prompt_len": np.array([3, 4]), "answer_len": np.array([5, 0])}
  packed = {"prompt_len": np.array([[3, 2], [4, 0]]), "answer_len": np.array([[5, 6], [1, 0]])}
  assert flops.example_lengths(unpacked).tolist() == [8, 4]
  assert flops.example_lengths(packed).tolist() == [8, 8, 5, 0]
  rates = flops.per_chip(flops=8e12, tokens=1000, seconds=2.0, chips=4, peak_flops=2e12)
  assert rates == pytest.approx(dict(tokens_per_second_per_chip=125.0, model_tflops_per_chip=1.0, mfu=0.5))
  assert "mfu" not in flops.per_chip(flops=8e12, tokens=1000, seconds=2.0, chips=4, peak_flops=None)


@pytest.mark.parametrize(
  "kind, peak",
  [
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("TPU v5", 459e12),
    ("TPU v5 lite", 197e12),
    ("cpu", None),
  ],
)
def test_peak_flops_by_device_kind(kind, peak):
  from types import SimpleNamespace

  from refusion_jax.parallel import compiled

  assert compiled.peak_flops(SimpleNamespace(device_kind=kind)) == peak
