"""Rematerialisation policies: what a decoder layer keeps for the backward pass (`ModelConfig.remat`).

The layer's intermediates are named with `jax.ad_checkpoint.checkpoint_name`
where they are computed (refusion_jax.model.transformer); a policy says which
names the backward pass may read from memory, everything else is recomputed
from the layer's input. Per token and layer of Qwen3-8B (embed 4096, 32 query
and 8 KV heads of 128, MLP 12288) the policies keep, besides the input:

| policy                   | kept                                   | elements / token | recomputed               |
| ------------------------ | -------------------------------------- | ---------------- | ------------------------ |
| `none`                   | everything (no rematerialisation)      | all              | nothing                  |
| `full`                   | nothing                                | 0                | the whole layer          |
| `projections`            | q, k, v, o; the MLP's gate, up, down   | 39k              | norms, RoPE, attention, SiLU |
| `projections_except_mlp` | q, k, v, o                             | 10k              | as above, and the MLP    |

`full` costs one more forward of every layer; `projections` costs no matmul
but the attention's (whose forward a fused kernel runs again), at about ten
times `full`'s activation memory; `projections_except_mlp` sits between.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

# The names the layers give their projections' outputs.
Q_PROJ, K_PROJ, V_PROJ, O_PROJ = "q_proj", "k_proj", "v_proj", "o_proj"
MLP_GATE, MLP_UP, MLP_DOWN = "mlp_gate", "mlp_up", "mlp_down"
_ATTENTION_PROJECTIONS = (Q_PROJ, K_PROJ, V_PROJ, O_PROJ)


# `ModelConfig.remat` name -> `jax.checkpoint` policy; None: no checkpointing at all.
POLICIES: dict[str, Callable | None] = {
  "none": None,
  "full": jax.checkpoint_policies.nothing_saveable,
  "projections": jax.checkpoint_policies.save_only_these_names(*_ATTENTION_PROJECTIONS, MLP_GATE, MLP_UP, MLP_DOWN),
  "projections_except_mlp": jax.checkpoint_policies.save_only_these_names(*_ATTENTION_PROJECTIONS),
}
