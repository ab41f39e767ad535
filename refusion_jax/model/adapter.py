"""The LoRA layer: one adapter beside one projection kernel, and the state filters that tell adapters apart.

This is the part of LoRA the transformer itself calls (`delta`), so it sits
below it; surgery on a whole `Transformer` (adding, merging, the abstract
model of a LoRA run) is `refusion_jax.model.lora`, above it
(docs/architecture.md, "LoRA").

A projection `W` [*in, *out] with an adapter computes `x·W + scale · (dropout(x)·A)·B`, with
A [*in, rank] and B [rank, *out]: one extra pair of contractions through a rank-`rank`
bottleneck, and `W` itself never changes. B starts at zero, so a fresh adapter leaves the
model's function exactly as it was. `scale` is `alpha / rank`, or `alpha / sqrt(rank)` with
`use_rslora` (peft's rank-stabilised variant).

The adapters are ordinary `nnx.Param`s on a small `LoraAdapter` module beside each adapted
kernel (`layers.{i}.self_attn.q_proj_lora.lora_a`), so they move with the rest of the layer's
state: through `lax.scan` over stacked layers, through every remat policy (the adapter's output
is part of the projection's named output), through `nnx.split` / `merge` and the sharding rules
(A carries the kernel's input axes, B its output axes, the rank axis is replicated).

They are always stored in float32, whatever the base's `param_dtype` (an int8 or int4 base
included: QLoRA), so the adapters train in float32 with float32 optimizer state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

# The kernels an adapter may sit on: module attribute -> (its parent's attribute in a decoder layer, how many of
# the kernel's leading axes are its input). The names are Hugging Face's, as peft's `target_modules` give them.
TARGETS: dict[str, tuple[str, int]] = {
  "q_proj": ("self_attn", 1),
  "k_proj": ("self_attn", 1),
  "v_proj": ("self_attn", 1),
  "o_proj": ("self_attn", 2),  # [heads, head_dim, embed]
  "gate_proj": ("mlp", 1),
  "up_proj": ("mlp", 1),
  "down_proj": ("mlp", 1),
}
# The official ReFusion recipe adapts attention only (peft `target_modules=["q_proj","k_proj","v_proj","o_proj"]`).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Adapter attribute = kernel attribute + this suffix.
SUFFIX = "_lora"
# The names of an adapter's two weights (leaves of the model state).
ADAPTER_WEIGHTS = ("lora_a", "lora_b")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """What adapters a model carries: `rank` 0 means none.

  rank: the bottleneck width r.
  alpha: the scale's numerator (peft's `lora_alpha`).
  dropout: dropout on an adapter's input during training (peft's `lora_dropout`); never at inference.
  targets: kernel names to adapt (`TARGETS`), peft's `target_modules`.
  use_rslora: scale by alpha / sqrt(rank) instead of alpha / rank.
  """

  rank: int = 0
  alpha: float = 16.0
  dropout: float = 0.0
  targets: tuple[str, ...] = DEFAULT_TARGETS
  use_rslora: bool = False

  def __post_init__(self):
    object.__setattr__(self, "targets", tuple(self.targets))  # a JSON or ConfigDict list, hashable again
    if self.rank < 0:
      raise ValueError(f"lora.rank={self.rank} must be >= 0 (0 turns LoRA off).")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"lora.dropout={self.dropout} must lie in [0, 1).")
    unknown = [t for t in self.targets if t not in TARGETS]
    if unknown or (self.rank and not self.targets):
      raise ValueError(
        f"lora.targets={list(self.targets)} names no adaptable module {unknown or ''}: this model's projections "
        f"are {list(TARGETS)} (peft's target_modules; the official recipe adapts {list(DEFAULT_TARGETS)})."
      )

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


class LoraAdapter(nnx.Module):
  """A and B of one kernel: A [*in, rank] (random), B [rank, *out] (zeros), float32."""

  def __init__(
    self,
    in_shape: Sequence[int],
    out_shape: Sequence[int],
    in_axes: Sequence[str | None],
    out_axes: Sequence[str | None],
    lora: LoraConfig,
    key: jax.Array,
  ):
    # peft's default init of A: Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    bound = 1.0 / math.sqrt(math.prod(in_shape))
    a = jax.random.uniform(key, (*in_shape, lora.rank), jnp.float32, -bound, bound)
    self.lora_a = nnx.Param(a, out_sharding=(*in_axes, None), eager_sharding=False)
    b = jnp.zeros((lora.rank, *out_shape), jnp.float32)
    self.lora_b = nnx.Param(b, out_sharding=(None, *out_axes), eager_sharding=False)
    self.lora = lora  # static: rank, scale and dropout are part of the graph, not of the state

  def __call__(self, x: jax.Array, dropout_key: jax.Array | None) -> jax.Array:
    """[batch, length, *in] -> [batch, length, *out] in x's dtype: scale · (dropout(x)·A)·B."""
    a, b = self.lora_a[...].astype(x.dtype), self.lora_b[...].astype(x.dtype)
    rate = self.lora.dropout
    if dropout_key is not None and rate > 0:
      keep = jax.random.bernoulli(dropout_key, 1.0 - rate, x.shape)
      x = jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)
    inputs = a.ndim - 1
    low = jnp.tensordot(x, a, axes=(tuple(range(x.ndim - inputs, x.ndim)), tuple(range(inputs))))
    return (self.lora.scale * jnp.tensordot(low, b, axes=1)).astype(x.dtype)


def delta(module: nnx.Module, kernel: str, x: jax.Array, dropout_key: jax.Array | None) -> jax.Array | float:
  """The adapter's contribution to `module.<kernel>`'s output for input x, or 0.0 when the kernel has none.

  Each kernel draws its own dropout mask (peft: one `nn.Dropout` per adapted module).
  """
  adapter = getattr(module, kernel + SUFFIX, None)
  if adapter is None:
    return 0.0
  key = None if dropout_key is None else jax.random.fold_in(dropout_key, list(TARGETS).index(kernel))
  return adapter(x, key)


def is_adapter(path: tuple, _value: object = None) -> bool:
  """Whether the state entry at `path` is an adapter weight (an `nnx` filter for `nnx.split` / `nnx.state`)."""
  names = [str(getattr(k, "key", k)) for k in path]
  return any(name.endswith(SUFFIX) for name in names)


def split_adapters(state: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(adapters, everything else) of a model's state."""
  return nnx.split_state(state, is_adapter, ...)


def trainable_part(params: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(what trains, what stays frozen) of a model's state: the adapters and the rest when it carries
  adapters, else everything and an empty state. `nnx.merge_state` of the two is `params` again."""
  adapters, frozen = split_adapters(params)
  if not jax.tree.leaves(adapters):
    return params, nnx.State({})
  return adapters, frozen
