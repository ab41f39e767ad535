"""Write a Hugging Face model as a MaxText checkpoint, in MaxText's documented layout (MaxText is not installable here).

Followed, in github.com/AI-Hypercomputer/maxtext:

- `src/maxtext/checkpoint_conversion/utils/param_mapping.py`: `QWEN_MAXTEXT_TO_HF_PARAM_MAPPING` /
  `LLAMA31_MAXTEXT_TO_HF_PARAM_MAPPING` (the names, scanned `decoder.layers.*` vs unscanned
  `decoder.layers_{i}.*`) and their `..._HOOK_FN`s: kernels are the transposed Hugging Face
  weights reshaped to [embed, heads, head_dim] / [heads, head_dim, embed]; Qwen biases are
  [heads, head_dim]; Llama q and k get `adjust_rope` (the two RoPE halves interleaved) and q
  `scale_query_layer` (× 1/√head_dim); the embedding may be zero-padded to a larger vocabulary.
- `src/maxtext/checkpoint_conversion/to_maxtext.py`: `_build_single_axis_stacked_tensor`
  stacks the layers of a scanned array at `config.param_scan_axis`
  (`src/maxtext/configs/base.yml`: `scan_layers: true`, `param_scan_axis: 1`).
- `src/maxtext/checkpoint_conversion/utils/utils.py`: `save_weights_to_checkpoint` saves a
  TrainState whose `params` is `{"params": weights}`, through
- `src/maxtext/common/checkpointing.py`: `create_orbax_checkpoint_manager` (one item named
  `items`, a PyTreeCheckpointHandler with OCDBT and zarr3) and `save_checkpoint`.
"""

from __future__ import annotations

import pathlib

import numpy as np
import orbax.checkpoint as ocp

from helpers.torch_reference import torch


def _interleave_rope(x: np.ndarray) -> np.ndarray:
  """MaxText's `adjust_rope` towards MaxText: [..., first half | second half] -> pairs side by side."""
  half = x.shape[-1] // 2
  return np.stack([x[..., :half], x[..., half:]], axis=-1).reshape(x.shape)


def _layer(weights: dict, i: int, config, llama: bool) -> dict:
  """One decoder layer's MaxText arrays from the Hugging Face state dict."""
  heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
  head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
  embed = config.hidden_size

  def w(name):
    return weights[f"model.layers.{i}.{name}"]

  query = w("self_attn.q_proj.weight").T.reshape(embed, heads, head_dim)
  key = w("self_attn.k_proj.weight").T.reshape(embed, kv_heads, head_dim)
  if llama:
    query = _interleave_rope(query) * np.float32(1 / np.sqrt(head_dim))
    key = _interleave_rope(key)
  attention = {
    "query": {"kernel": query},
    "key": {"kernel": key},
    "value": {"kernel": w("self_attn.v_proj.weight").T.reshape(embed, kv_heads, head_dim)},
    "out": {"kernel": w("self_attn.o_proj.weight").T.reshape(heads, head_dim, embed)},
  }
  for ours, theirs, count in (("q", "query", heads), ("k", "key", kv_heads), ("v", "value", kv_heads)):
    if f"model.layers.{i}.self_attn.{ours}_proj.bias" in weights:
      attention[theirs]["bias"] = w(f"self_attn.{ours}_proj.bias").reshape(count, head_dim)
  for ours, theirs in (("q_norm", "query_norm"), ("k_norm", "key_norm")):
    if f"model.layers.{i}.self_attn.{ours}.weight" in weights:
      attention[theirs] = {"scale": w(f"self_attn.{ours}.weight")}
  return {
    "pre_self_attention_layer_norm": {"scale": w("input_layernorm.weight")},
    "post_self_attention_layer_norm": {"scale": w("post_attention_layernorm.weight")},
    "self_attention": attention,
    "mlp": {
      "wi_0": {"kernel": w("mlp.gate_proj.weight").T},
      "wi_1": {"kernel": w("mlp.up_proj.weight").T},
      "wo": {"kernel": w("mlp.down_proj.weight").T},
    },
  }


def _stack(layers: list, axis: int):
  """The layers' trees as one tree of stacks, the layer axis inserted at `axis`."""
  if isinstance(layers[0], dict):
    return {key: _stack([layer[key] for layer in layers], axis) for key in layers[0]}
  return np.stack(layers, axis=axis)


def maxtext_params(model, *, scanned: bool, padded_vocab: int | None = None, scan_axis: int = 1) -> dict:
  """`params.params` of a MaxText checkpoint of the transformers `model` (Qwen3 / Qwen2 / Llama)."""
  config = model.config
  weights = {name: t.detach().to(torch.float32).numpy().copy() for name, t in model.state_dict().items()}
  llama = config.model_type == "llama"
  vocab = padded_vocab or config.vocab_size

  def pad(rows: np.ndarray) -> np.ndarray:  # [vocab, embed] -> [padded vocab, embed], zeros appended
    return np.concatenate([rows, np.zeros((vocab - rows.shape[0], rows.shape[1]), rows.dtype)])

  layers = [_layer(weights, i, config, llama) for i in range(config.num_hidden_layers)]
  decoder = {"decoder_norm": {"scale": weights["model.norm.weight"]}}
  if scanned:
    decoder["layers"] = _stack(layers, scan_axis)
  else:
    decoder.update({f"layers_{i}": layer for i, layer in enumerate(layers)})
  if not config.tie_word_embeddings:
    decoder["logits_dense"] = {"kernel": pad(weights["lm_head.weight"]).T}
  return {"token_embedder": {"embedding": pad(weights["model.embed_tokens.weight"])}, "decoder": decoder}


def save_maxtext(root: pathlib.Path, params: dict, step: int = 0) -> None:
  """Save `params` as MaxText does: `<root>/<step>/items`, a TrainState tree with an optimizer state beside it."""
  state = {
    "step": np.int32(step),
    "params": {"params": params},
    # Adam moments mirror the params; they must never be read.
    "opt_state": {
      "mu": {"params": {"token_embedder": {"embedding": np.ones_like(params["token_embedder"]["embedding"])}}}
    },
  }
  handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)
  with ocp.CheckpointManager(root, item_names=("items",), item_handlers={"items": handler}) as manager:
    manager.save(step, args=ocp.args.Composite(items=ocp.args.PyTreeSave(state)))
    manager.wait_until_finished()
