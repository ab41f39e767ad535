"""Fitting a Hugging Face checkpoint to ReFusion: a mask token in its tokenizer, a row for it in its embeddings.

ReFusion feeds a mask token for every undecided position (docs/method.md §1).
Base checkpoints such as Qwen3 have none, so fine-tuning one starts by adding
`MASK_TOKEN` to a copy of its tokenizer (the next free id) and, when that id
lies past the embedding table, by growing the table (`resize_vocab`).
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import tokenizers
from flax import nnx

MASK_TOKEN = "<|mask|>"
# Tokenizer and model configs copied along with the extended tokenizer.json.
_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "config.json")


def add_mask_token(tokenizer_dir: str, out_dir: str) -> None:
  """Copy a Hugging Face tokenizer to `out_dir` with `MASK_TOKEN` added (the next free id) as its mask token."""
  os.makedirs(out_dir, exist_ok=True)
  for name in _TOKENIZER_FILES:
    if os.path.exists(os.path.join(tokenizer_dir, name)):
      shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
  tokenizer = tokenizers.Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
  tokenizer.add_special_tokens([tokenizers.AddedToken(MASK_TOKEN, special=True)])
  tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
  config_file = os.path.join(out_dir, "tokenizer_config.json")
  tokenizer_config = {}
  if os.path.exists(config_file):
    with open(config_file, encoding="utf-8") as f:
      tokenizer_config = json.load(f)
  tokenizer_config["mask_token"] = MASK_TOKEN
  with open(config_file, "w", encoding="utf-8") as f:
    json.dump(tokenizer_config, f, indent=2)


def resize_vocab(params: nnx.State, new_vocab: int, key: jax.Array, noise_scale: float = 1e-3) -> nnx.State:
  """Grow the embedding [vocab, embed] (and an untied LM head [embed, vocab]) to `new_vocab` rows.

  New rows are the mean of the existing ones plus small Gaussian noise (scaled
  by their standard deviation): a new token then starts as an "average" token
  instead of an outlier the softmax would have to unlearn.
  """

  def grow(table: jax.Array, key: jax.Array) -> jax.Array:  # [vocab, embed]
    extra = new_vocab - table.shape[0]
    mean = table.astype(jnp.float32).mean(0)
    std = table.astype(jnp.float32).std(0)
    rows = mean + noise_scale * std * jax.random.normal(key, (extra, table.shape[1]))
    return jnp.concatenate([table, rows.astype(table.dtype)])

  embed_key, head_key = jax.random.split(key)
  params = jax.tree.map(lambda x: x, params)  # a copy whose variables we may replace
  params["embed_tokens"] = params["embed_tokens"].replace(grow(params["embed_tokens"].get_value(), embed_key))
  if "lm_head" in params:
    params["lm_head"] = params["lm_head"].replace(grow(params["lm_head"].get_value().T, head_key).T)
  return params
