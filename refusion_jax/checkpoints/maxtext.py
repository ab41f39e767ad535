"""MaxText checkpoints: the `items` PyTree of a MaxText TrainState, scanned or unscanned layers.

MaxText (github.com/AI-Hypercomputer/maxtext) saves `<root>/<step>/items`, an
orbax PyTree (OCDBT, zarr3) of its TrainState, the model under
`params.params` (`src/maxtext/common/checkpointing.py`: `save_checkpoint`;
`checkpoint_conversion/utils/utils.py`: `save_weights_to_checkpoint`). The
names and layouts below follow its Hugging Face converters
(`checkpoint_conversion/utils/param_mapping.py`: `QWEN_MAXTEXT_TO_HF_PARAM_MAPPING`,
`LLAMA31_MAXTEXT_TO_HF_PARAM_MAPPING` and their `..._HOOK_FN`s):

| MaxText array under `params.params.`                 | per-layer shape          | ours                     |
| ---------------------------------------------------- | ------------------------ | ------------------------ |
| `token_embedder.embedding`                           | [vocab (padded), embed]  | `embed_tokens`           |
| `decoder.logits_dense.kernel` (absent when tied)     | [embed, vocab (padded)]  | `lm_head`                |
| `decoder.decoder_norm.scale`                         | [embed]                  | `norm.weight`            |
| `decoder.layers.self_attention.{query,key,value}.kernel` | [embed, (kv_)heads, head_dim] | `self_attn.{q,k,v}_proj` |
| `decoder.layers.self_attention.out.kernel`           | [heads, head_dim, embed] | `self_attn.o_proj`       |
| `decoder.layers.self_attention.{query,key,value}.bias` | [(kv_)heads, head_dim] | `self_attn.{q,k,v}_bias` |
| `decoder.layers.self_attention.{query,key}_norm.scale` | [head_dim]             | `self_attn.{q,k}_norm.weight` |
| `decoder.layers.{pre,post}_self_attention_layer_norm.scale` | [embed]           | the layer norms          |
| `decoder.layers.mlp.wi_0.kernel` / `wi_1` / `wo`     | [embed, mlp] / [mlp, embed] | gate / up / down      |

With scanned layers (MaxText's default `scan_layers: true`) every layer array
is one stack with the layer axis inserted at `param_scan_axis` (default 1),
e.g. the query kernel [embed, layers, heads, head_dim]; unscanned checkpoints
name each layer `decoder.layers_{i}`. For Llama, MaxText stores q and k with
their RoPE halves interleaved (pairs (x_i, x_{i+D/2}) side by side) and q
pre-scaled by 1/√head_dim; both are undone here. Optimizer state and the step
are never read.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from refusion_jax.checkpoints import orbax_tree
from refusion_jax.checkpoints.mapping import Rule, Table
from refusion_jax.checkpoints.restore import Source

ITEM = "items"
# The layer axis of scanned arrays: MaxText's default `param_scan_axis`.
SCAN_AXIS = 1

_ROOT = "params.params."
_EMBEDDING = _ROOT + "token_embedder.embedding"
_SCANNED = _ROOT + "decoder.layers."
_UNSCANNED = _ROOT + "decoder.layers_{layer}."


def _deinterleave(x, shape):
  """[..., head_dim] with RoPE pairs side by side -> Hugging Face's halves (MaxText's `adjust_rope`, undone)."""
  return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _llama_query(x, shape):
  """Undo MaxText's Llama query: RoPE interleaving and the 1/√head_dim folded into the kernel."""
  return (_deinterleave(x, shape).astype(jnp.float32) * math.sqrt(shape[-1])).astype(x.dtype)


def _layer_rules(architecture: str) -> list[tuple[str, str, tuple[str, ...], object]]:
  """(MaxText name within a layer, our name within a layer, per-layer axes, conversion)."""
  llama = architecture == "llama"
  return [
    ("pre_self_attention_layer_norm.scale", "input_layernorm.weight", ("embed",), None),
    ("post_self_attention_layer_norm.scale", "post_attention_layernorm.weight", ("embed",), None),
    (
      "self_attention.query.kernel",
      "self_attn.q_proj",
      ("embed", "heads", "head_dim"),
      _llama_query if llama else None,
    ),
    (
      "self_attention.key.kernel",
      "self_attn.k_proj",
      ("embed", "kv_heads", "head_dim"),
      _deinterleave if llama else None,
    ),
    ("self_attention.value.kernel", "self_attn.v_proj", ("embed", "kv_heads", "head_dim"), None),
    ("self_attention.out.kernel", "self_attn.o_proj", ("heads", "head_dim", "embed"), None),
    ("self_attention.query.bias", "self_attn.q_bias", ("heads", "head_dim"), None),
    ("self_attention.key.bias", "self_attn.k_bias", ("kv_heads", "head_dim"), None),
    ("self_attention.value.bias", "self_attn.v_bias", ("kv_heads", "head_dim"), None),
    ("self_attention.query_norm.scale", "self_attn.q_norm.weight", ("head_dim",), None),
    ("self_attention.key_norm.scale", "self_attn.k_norm.weight", ("head_dim",), None),
    ("mlp.wi_0.kernel", "mlp.gate_proj", ("embed", "mlp"), None),
    ("mlp.wi_1.kernel", "mlp.up_proj", ("embed", "mlp"), None),
    ("mlp.wo.kernel", "mlp.down_proj", ("mlp", "embed"), None),
  ]


def table(architecture: str = "qwen3") -> Table:
  """The MaxText table of one family (Llama's q/k need converting; Qwen's are stored as ours)."""
  rules = [
    Rule(_EMBEDDING, "embed_tokens", ("padded_vocab", "embed")),
    Rule(_ROOT + "decoder.logits_dense.kernel", "lm_head", ("embed", "padded_vocab")),
    Rule(_ROOT + "decoder.decoder_norm.scale", "norm.weight", ("embed",)),
  ]
  for stored, ours, axes, convert in _layer_rules(architecture):
    scanned_axes = axes[:SCAN_AXIS] + ("layers",) + axes[SCAN_AXIS:]
    rules.append(Rule(_SCANNED + stored, "layers.{layer}." + ours, scanned_axes, convert))
    rules.append(Rule(_UNSCANNED + stored, "layers.{layer}." + ours, axes, convert))
  return Table(rules)


def _check_scan_axis(arrays: dict, location: str) -> None:
  """Scanned stacks must share one layer count at `SCAN_AXIS` and leave the embedding width on the norms."""
  scanned = {name: shape for name, (shape, _) in arrays.items() if name.startswith(_SCANNED)}
  norm = scanned.get(_SCANNED + "pre_self_attention_layer_norm.scale")
  if not scanned or norm is None or _EMBEDDING not in arrays:
    return
  embed = arrays[_EMBEDDING][0][-1]
  counts = {shape[SCAN_AXIS] if len(shape) > SCAN_AXIS else None for shape in scanned.values()}
  if len(counts) > 1 or len(norm) != 2 or norm[1 - SCAN_AXIS] != embed:
    listing = ", ".join(f"{name.removeprefix(_ROOT)} {shape}" for name, shape in sorted(scanned.items())[:4])
    raise ValueError(
      f"The scanned layers of the {location} do not have their layer axis at param_scan_axis={SCAN_AXIS} "
      f"(MaxText's default; the embedding width is {embed}): {listing}, ... The checkpoint was written with "
      "another param_scan_axis; convert it with MaxText's default, or unscanned (scan_layers=false)."
    )


def model_arrays(item_dir: str) -> dict[str, tuple[tuple[int, ...], object]]:
  """The arrays under `params.params` of the `items` item at `item_dir` (the step and optimizer state left out)."""
  return {name: value for name, value in orbax_tree.item_arrays(item_dir).items() if name.startswith(_ROOT)}


def maxtext_source(item_dir: str, location: str, architecture: str = "qwen3") -> Source:
  """The MaxText `items` item at `item_dir`; only `params.params` is read (no optimizer state)."""
  arrays = model_arrays(item_dir)
  _check_scan_axis(arrays, location)
  return Source(
    format="maxtext",
    location=location,
    arrays=arrays,
    table=table(architecture),
    fetch=orbax_tree.fetcher(item_dir),
  )
