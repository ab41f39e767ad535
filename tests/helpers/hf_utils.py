"""Tiny random Hugging Face models for the checkpoint and parity tests."""

from __future__ import annotations

import pathlib

import numpy as np
import transformers

from helpers.torch_reference import torch

_FAMILIES = {
  "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
  "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
  "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
}


def tiny_hf_model(family: str, seed: int = 0, **config_fields) -> transformers.PreTrainedModel:
  """A small random float32 causal LM of `family` in eval mode.

  Every parameter gets extra random noise, so q/k norms are not all ones and
  biases not all zeros: a tensor loaded into the wrong place shows up.
  """
  config_class, model_class = _FAMILIES[family]
  fields = dict(
    vocab_size=211,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
  )
  fields.update(config_fields)
  torch.manual_seed(seed)
  model = model_class(config_class(**fields, attn_implementation="eager")).eval()
  with torch.no_grad():
    for param in model.parameters():
      param.add_(0.2 * torch.randn_like(param))
  return model


def save_tiny_hf_model(directory: pathlib.Path, family: str, seed: int = 0, **config_fields):
  """`tiny_hf_model` saved with `save_pretrained` into `directory`; returns the model."""
  model = tiny_hf_model(family, seed, **config_fields)
  model.save_pretrained(directory)
  return model


def hf_logits(
  model: transformers.PreTrainedModel, tokens: np.ndarray, positions: np.ndarray | None = None
) -> np.ndarray:
  """Logits [batch, length, vocab] of a transformers model as float32 numpy."""
  kwargs = {} if positions is None else {"position_ids": torch.from_numpy(np.asarray(positions, np.int64))}
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(np.asarray(tokens, np.int64)), **kwargs)
  return out.logits.float().numpy()
