"""tunix checkpoints (Qwen3, Qwen2, Llama 3) as tunix's own checkpoint manager writes them.

`tunix.sft.checkpoint_manager.CheckpointManager` saves `nnx.state(model)` as an
orbax PyTree item `<root>/<step>/model_params` (the optimizer, if saved, is a
separate `optimizer_state` item we never read). Its tree, from tunix's
`models/{qwen3,qwen2,llama3}/model.py`:

| tunix array                                   | shape                    | ours                          |
| --------------------------------------------- | ------------------------ | ----------------------------- |
| `embedder.input_embedding.value`              | [vocab, embed]           | `embed_tokens`                |
| `layers.{i}.attn.{q,k,v}_proj.w.value`        | [embed, (kv_)heads, head_dim] | `self_attn.{q,k,v}_proj` |
| `layers.{i}.attn.o_proj.w.value`              | [heads, head_dim, embed] | `self_attn.o_proj`            |
| `layers.{i}.attn.{q,k}_norm.w.value` (Qwen3)  | [head_dim]               | `self_attn.{q,k}_norm.weight` |
| `layers.{i}.attn.{q,k,v}_bias.value` (Qwen2)  | [(kv_)heads · head_dim]  | `self_attn.{q,k,v}_bias`      |
| `layers.{i}.mlp.{gate,up,down}_proj.kernel.value` | [embed, mlp] / [mlp, embed] | `mlp.*_proj`           |
| `layers.{i}.{input,post_attention}_layernorm.w.value`, `final_norm.w.value` | [embed] | the norms |
| `lm_head.w.value` (absent when tied)          | [embed, vocab]           | `lm_head`                     |

Everything but the flat Qwen2 biases is already in our layout, so the whole
model is restored in one orbax call straight onto the target shardings.

tunix does not store the architecture's scalars (RoPE theta, norm epsilon),
and its Qwen3 and Llama 3 apply RoPE with theta 1e6 whatever their config
says: load with the config whose forward you want to reproduce.

A LoRA run saved with `save_only_lora_params=True` holds only the adapters
(`*_lora_a`, `*_lora_b`), and a full save of a LoRA model holds them beside
the base weights; both are refused with that said, since loading either as a
plain model would silently drop the fine-tune.
"""

from __future__ import annotations

import re

from refusion_jax.checkpoints import orbax_tree
from refusion_jax.checkpoints.mapping import Rule, Table, split_heads
from refusion_jax.checkpoints.restore import Source

ITEM = "model_params"

# Both trees number their layers the same way: a layer's prefix, on the tunix side and ours.
_LAYER = "layers.{layer}."
TABLE = Table(
  [
    Rule("embedder.input_embedding.value", "embed_tokens", ("vocab", "embed")),
    Rule("final_norm.w.value", "norm.weight", ("embed",)),
    Rule("lm_head.w.value", "lm_head", ("embed", "vocab")),
    Rule(_LAYER + "input_layernorm.w.value", _LAYER + "input_layernorm.weight", ("embed",)),
    Rule(_LAYER + "post_attention_layernorm.w.value", _LAYER + "post_attention_layernorm.weight", ("embed",)),
    Rule(_LAYER + "attn.q_proj.w.value", _LAYER + "self_attn.q_proj", ("embed", "heads", "head_dim")),
    Rule(_LAYER + "attn.{kv}_proj.w.value", _LAYER + "self_attn.{kv}_proj", ("embed", "kv_heads", "head_dim")),
    Rule(_LAYER + "attn.o_proj.w.value", _LAYER + "self_attn.o_proj", ("heads", "head_dim", "embed")),
    Rule(_LAYER + "attn.{qk}_norm.w.value", _LAYER + "self_attn.{qk}_norm.weight", ("head_dim",)),
    Rule(_LAYER + "attn.q_bias.value", _LAYER + "self_attn.q_bias", ("heads*head_dim",), split_heads),
    Rule(_LAYER + "attn.{kv}_bias.value", _LAYER + "self_attn.{kv}_bias", ("kv_heads*head_dim",), split_heads),
    Rule(_LAYER + "mlp.{gate_up}_proj.kernel.value", _LAYER + "mlp.{gate_up}_proj", ("embed", "mlp")),
    Rule(_LAYER + "mlp.down_proj.kernel.value", _LAYER + "mlp.down_proj", ("mlp", "embed")),
  ]
)

_LORA = re.compile(r"_lora_[ab](\.value)?$")


def _refuse_lora(arrays: dict, location: str) -> None:
  adapters = sorted(name for name in arrays if _LORA.search(name))
  if not adapters:
    return
  if len(adapters) == len(arrays):
    raise ValueError(
      f"The {location} is LoRA-only (saved with save_only_lora_params=True): its {len(adapters)} arrays are "
      f"adapters such as {adapters[0]}, not model weights. Load the base model and merge the adapters in tunix, "
      "then save the whole model (save_only_lora_params=False) and load that."
    )
  raise ValueError(
    f"The {location} holds LoRA adapters ({len(adapters)} arrays such as {adapters[0]}) beside the base weights; "
    "loading it as a plain model would drop them. Merge the adapters into the weights in tunix and save again."
  )


def tunix_source(item_dir: str, location: str) -> Source:
  """The tunix `model_params` item at `item_dir` (`location` says where it was found, for messages)."""
  arrays = orbax_tree.item_arrays(item_dir)
  _refuse_lora(arrays, location)
  return Source(format="tunix", location=location, arrays=arrays, table=TABLE, fetch=orbax_tree.fetcher(item_dir))
