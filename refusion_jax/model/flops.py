"""Model FLOPs of a training step, counted as MaxText and the MFU literature count them.

A step's *model* FLOPs are what the model needs, whatever an implementation
spends on top: 6 FLOPs per matmul weight per token (2 forward, 4 backward)
plus the attention scores and their weighted sum, over real tokens only
(padding is not work). Rematerialisation, padding and masked-out blocks are not
counted, so `model FLOPs / (seconds × chips × peak)` is the model FLOPs
utilisation (MFU) a run earns for its users.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from refusion_jax.model.config import ModelConfig


def matmul_weights(config: ModelConfig) -> int:
  """Weights a token is multiplied by in one forward: every projection of every layer, and the LM head.

  The embedding lookup is a gather, not a matmul, and norms and biases are negligible.
  """
  c = config
  attention = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)  # q, o and k, v
  mlp = 3 * c.hidden_size * c.intermediate_size
  return c.num_layers * (attention + mlp) + c.hidden_size * c.vocab_size


def attention_pairs(segment_lengths: Sequence[int] | np.ndarray, causal: bool = True) -> int:
  """(query, key) pairs attention scores: L(L+1)/2 per causal segment of L tokens, L² per bidirectional one."""
  lengths = np.asarray(segment_lengths, np.int64)
  return int(np.sum(lengths * (lengths + 1) // 2 if causal else lengths * lengths))


def training_flops(config: ModelConfig, segment_lengths: Sequence[int] | np.ndarray, causal: bool = True) -> float:
  """Model FLOPs of one training step (forward and backward) over examples of the given lengths.

  Args:
    segment_lengths: the real tokens of each example (prompt + answer), padding excluded.
    causal: attention within an example is causal (ReFusion, AR) or full (MDM).
  """
  tokens = int(np.sum(np.asarray(segment_lengths, np.int64)))
  # Per (query, key) pair and layer: q.k and p.v, 2 FLOPs per multiply-add over every head's head_dim.
  attention = 4 * config.num_layers * config.num_heads * config.head_dim * attention_pairs(segment_lengths, causal)
  return 3.0 * (2 * matmul_weights(config) * tokens + attention)


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
