"""Fitting a Hugging Face checkpoint to ReFusion: a mask token in its tokenizer, a row for it in its embeddings.

ReFusion feeds a mask token for every undecided position (docs/method.md §1).
Base checkpoints such as Qwen3 have none, so fine-tuning one starts by adding
`MASK_TOKEN` to a copy of its tokenizer (the next free id) and, when that id
lies past the embedding table, by growing the table (`resize_vocab`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import tokenizers
from flax import nnx
from jax.experimental import multihost_utils

from refusion_jax.checkpoints import hf as hf_io
from refusion_jax.data.special_tokens import SpecialTokens, resolve_special_tokens, with_special_tokens
from refusion_jax.data.tokenizer import load_tokenizer
from refusion_jax.model.config import ModelConfig

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


@dataclasses.dataclass
class HFStart:
  """A Hugging Face checkpoint made ready to train ReFusion.

  params: the model's parameters, embeddings grown if the mask id needed it.
  model_config: its config, special ids resolved (mask, then tokenizer, then config.json).
  tokenizer_path: the checkpoint's tokenizer, or the extended copy holding the added mask token.
  added_mask_id: the id of `MASK_TOKEN` when it was added, else None.
  resized_from: the vocabulary size before growing the embeddings, else None.
  """

  params: nnx.State
  model_config: ModelConfig
  tokenizer_path: str
  added_mask_id: int | None = None
  resized_from: int | None = None


def load_hf_for_training(
  path: str,
  tokens_dir: str,
  *,
  dtype: str,
  param_dtype: str | None,
  vocab_multiple: int,
  seed: int,
) -> HFStart:
  """Load a Hugging Face checkpoint to fine-tune it into ReFusion.

  If the tokenizer has no mask token, one is added (process 0 writes the
  extended tokenizer to `tokens_dir`, the other processes wait for it) and the
  embeddings are resized to hold it, rounded up to a multiple of
  `vocab_multiple` so the vocabulary still shards.
  """
  model = hf_io.load_hf(path, dtype=dtype, param_dtype=param_dtype)
  model_config, params = model.config, nnx.state(model)
  start = HFStart(params, model_config, tokenizer_path=path)
  mask_id = model_config.mask_token_id
  if mask_id is None:
    if jax.process_index() == 0:  # one writer; the others read it after the barrier
      add_mask_token(path, tokens_dir)
    multihost_utils.sync_global_devices("refusion_jax: tokenizer with a mask token written")
    mask_id = load_tokenizer(tokens_dir).mask_id
    start.tokenizer_path, start.added_mask_id = tokens_dir, mask_id
  if mask_id >= model_config.vocab_size:
    new_vocab = -(-(mask_id + 1) // vocab_multiple) * vocab_multiple
    start.params = resize_vocab(params, new_vocab, jax.random.PRNGKey(seed))
    start.resized_from = model_config.vocab_size
    model_config = model_config.replace(vocab_size=new_vocab)
  ids = resolve_special_tokens(
    SpecialTokens(mask=mask_id), tokenizer=load_tokenizer(start.tokenizer_path), config=model_config
  )
  start.model_config = with_special_tokens(model_config, ids)
  return start
