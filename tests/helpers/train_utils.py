"""Helpers for tests that run the trainer: the repo root, the smoke configs and a tiny HF checkpoint."""

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tokenizers
from flax import nnx

from refusion_jax.checkpoints import hf as hf_io
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import Transformer, init_model
from refusion_jax.training import config_file
from refusion_jax.training import loop as train
from refusion_jax.training import state as train_state
from refusion_jax.training.objective import ObjectiveConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_config(name: str, variant: str = "smoke") -> ml_collections.ConfigDict:
  """`configs/<name>.py`'s get_config(variant)."""
  return config_file.load_config(os.path.join(REPO, "configs", f"{name}.py"), variant)


def smoke_config(data_dir: str, name: str = "demo", **overrides) -> ml_collections.ConfigDict:
  config = load_config(name)
  config.data.data_dir = data_dir
  config.update(overrides)
  return config


def lora_run_straight_and_resumed(tmp_path, data_dir: str, **overrides) -> tuple[ml_collections.ConfigDict, Any, Any]:
  """A rank-4 LoRA run as a real one has it (scanned and rematerialised layers, packed rows, the chunked loss, two
  microbatches; `overrides` on the config): 6 steps straight in tmp_path/straight, and in tmp_path/resumed
  stopped after step 3, then resumed. Returns (its config, the straight run, the resumed run's second part)."""
  config = smoke_config(data_dir, num_train_steps=6, eval_every=0, grad_accum_steps=2, **overrides)
  config.model.update(scan_layers=True, remat="full")
  config.objective.loss_chunk = 16
  config.lora.update(rank=4, dropout=0.1)
  straight = train.train_and_evaluate(config, str(tmp_path / "straight"))
  config.stop_after_step = 3
  train.train_and_evaluate(config, str(tmp_path / "resumed"))
  config.stop_after_step = -1
  return config, straight, train.train_and_evaluate(config, str(tmp_path / "resumed"))


def adapter_steps(model: Transformer, steps: int = 2) -> tuple[train_state.TrainState, train_state.TrainState]:
  """`steps` Adam steps (lr 1e-2) of the ReFusion objective on one random batch from `model`'s parameters (a model
  with LoRA adapters; B starts at zero, so A's gradient does too: two steps move both). Returns the state before
  and after; the last loss must be finite."""
  graphdef, params = nnx.split(model)
  tx = optax.adam(1e-2)
  objective = ObjectiveConfig(kind="refusion", slot_sizes=(4,), eps=1e-3, mask_id=95, pad_id=0, loss_chunk=0)
  before = state = train_state._state_from_params(params, tx, seed=0)
  rng = np.random.default_rng(0)
  batch = dict(
    tokens=jnp.asarray(rng.integers(1, 90, (4, 24)), jnp.int32),
    prompt_len=jnp.full((4,), 8, jnp.int32),
    answer_len=jnp.full((4,), 12, jnp.int32),
  )
  step = jax.jit(train_state.make_train_step(graphdef, tx, optax.constant_schedule(1e-2), objective, 1))
  for _ in range(steps):
    state, metrics = step(state, batch)
  assert np.isfinite(float(metrics["loss"]))
  return before, state


def write_hf_checkpoint(path, tokenizer_config: dict | None = None) -> int:
  """A tiny Qwen3 checkpoint with a character tokenizer that has no mask token; returns its vocab size.

  The model is `tiny(vocab_size=<returned size>, tie_embeddings=False)`.
  """
  chars = [chr(c) for c in range(32, 127)]
  vocab = {c: i for i, c in enumerate(chars + ["<unk>", "<|endoftext|>"])}
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
  tokenizer.decoder = tokenizers.decoders.Fuse()
  tokenizer.add_special_tokens([tokenizers.AddedToken("<|endoftext|>", special=True)])
  os.makedirs(path, exist_ok=True)
  tokenizer.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<|endoftext|>", **(tokenizer_config or {})}, f)
  model_config = tiny(vocab_size=len(vocab), tie_embeddings=False, eos_token_id=vocab["<|endoftext|>"])
  hf_io.save_hf(init_model(model_config, seed=3), path)
  return len(vocab)
