"""Model FLOPs of a training step, counted as MaxText and the MFU literature count them.

A step's *model* FLOPs are what the model needs, whatever an implementation
spends on top: 6 FLOPs per matmul weight per token (2 forward, 4 backward)
plus the attention scores and their weighted sum, over real tokens only
(padding is not work). Rematerialisation, padding and masked-out blocks are not
counted, so `model FLOPs / (seconds × chips × peak)` is the model FLOPs
utilisation (MFU) a run earns for its users.

A LoRA step trains the adapters only: a frozen kernel costs 2 FLOPs per weight
per token forward and 2 for the gradient of its input, but no weight gradient
(4, not 6); the adapters' own weights cost the full 6.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from refusion_jax.model.config import ModelConfig
from refusion_jax.model.lora import TARGETS, LoraConfig


def matmul_weights(config: ModelConfig) -> int:
  """Weights a token is multiplied by in one forward: every projection of every layer, and the LM head.

  The embedding lookup is a gather, not a matmul, and norms and biases are negligible.
  """
  c = config
  attention = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)  # q, o and k, v
  mlp = 3 * c.hidden_size * c.intermediate_size
  return c.num_layers * (attention + mlp) + c.hidden_size * c.vocab_size


def adapter_weights(config: ModelConfig, lora: LoraConfig) -> int:
  """Weights of every adapter (A and B, rank·(in + out) each) a token is multiplied by in one forward."""
  c = config
  widths = {
    "q_proj": (c.hidden_size, c.num_heads * c.head_dim),
    "k_proj": (c.hidden_size, c.num_kv_heads * c.head_dim),
    "v_proj": (c.hidden_size, c.num_kv_heads * c.head_dim),
    "o_proj": (c.num_heads * c.head_dim, c.hidden_size),
    "gate_proj": (c.hidden_size, c.intermediate_size),
    "up_proj": (c.hidden_size, c.intermediate_size),
    "down_proj": (c.intermediate_size, c.hidden_size),
  }
  assert set(widths) == set(TARGETS), "a new adapter target needs its widths here"
  return c.num_layers * sum(lora.rank * sum(widths[t]) for t in lora.targets) if lora.enabled else 0


def attention_pairs(segment_lengths: Sequence[int] | np.ndarray, causal: bool = True) -> int:
  """(query, key) pairs attention scores: L(L+1)/2 per causal segment of L tokens, L² per bidirectional one."""
  lengths = np.asarray(segment_lengths, np.int64)
  return int(np.sum(lengths * (lengths + 1) // 2 if causal else lengths * lengths))


def training_flops(
  config: ModelConfig,
  segment_lengths: Sequence[int] | np.ndarray,
  causal: bool = True,
  lora: LoraConfig | None = None,
) -> float:
  """Model FLOPs of one training step (forward and backward) over examples of the given lengths.

  Args:
    segment_lengths: the real tokens of each example (prompt + answer), padding excluded.
    causal: attention within an example is causal (ReFusion, AR) or full (MDM).
    lora: the adapters of a LoRA step (frozen kernels get no weight gradient); None or rank 0: every weight trains.
  """
  tokens = int(np.sum(np.asarray(segment_lengths, np.int64)))
  # Per (query, key) pair and layer: q.k and p.v, 2 FLOPs per multiply-add over every head's head_dim.
  attention = 4 * config.num_layers * config.num_heads * config.head_dim * attention_pairs(segment_lengths, causal)
  if lora is None or not lora.enabled:
    return 3.0 * (2 * matmul_weights(config) * tokens + attention)
  frozen = 2 * (2 * matmul_weights(config) * tokens)  # forward and input gradient, no weight gradient
  return frozen + 3.0 * (2 * adapter_weights(config, lora) * tokens + attention)


def example_lengths(batch: Mapping[str, np.ndarray]) -> np.ndarray:
  """[examples] the real tokens of each example of a training batch (prompt + answer; 0 for unused segments).

  Batch: prompt_len and answer_len [batch] (one example per row) or [batch, segments] (packed rows).
  """
  return (np.asarray(batch["prompt_len"], np.int64) + np.asarray(batch["answer_len"], np.int64)).ravel()


def per_chip(flops: float, tokens: int, seconds: float, chips: int, peak_flops: float | None) -> dict[str, float]:
  """What `seconds` of `chips` earned: real tokens/s and model TFLOP/s per chip, and MFU against `peak_flops`.

  `mfu` is left out when the chip's peak is unknown (`peak_flops` None: CPUs, unlisted devices).
  """
  seconds = max(seconds, 1e-9)
  scalars = dict(
    tokens_per_second_per_chip=tokens / seconds / chips,
    model_tflops_per_chip=flops / seconds / chips / 1e12,
  )
  if peak_flops:
    scalars["mfu"] = flops / seconds / chips / peak_flops
  return scalars
