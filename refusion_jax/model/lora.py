"""Low-rank adapters (LoRA) on the frozen projections of the transformer (docs/architecture.md, "LoRA").

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

    model = add_lora(base_model, LoraConfig(rank=8, alpha=16))   # B = 0: same logits as base_model
    merged = merge_lora(model)                                    # W + scale·A·B, adapters gone

They are always stored in float32, whatever the base's `param_dtype`, so a bfloat16 base
trains float32 adapters with float32 optimizer state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

if TYPE_CHECKING:  # the transformer calls `delta`: this module cannot import it at load time
  from refusion_jax.model.config import ModelConfig
  from refusion_jax.model.transformer import Transformer

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
# Where a training step's dropout key for the adapters comes from: fold_in(step key, this), a stream no other
# draw of the step uses.
_DROPOUT_STREAM = 0x10A


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


def adapted_kernels(model: Transformer) -> Iterator[tuple[int, str, nnx.Module, LoraAdapter]]:
  """(layer index, kernel name, parent module, adapter) of every adapter of `model`, in layer order."""
  for i, layer in enumerate(model.layers):
    for kernel, (parent_name, _) in TARGETS.items():
      parent = getattr(layer, parent_name)
      adapter = getattr(parent, kernel + SUFFIX, None)
      if adapter is not None:
        yield i, kernel, parent, adapter


def lora_config_of(model: Transformer) -> LoraConfig:
  """The `LoraConfig` of the adapters `model` carries (rank 0 when it carries none)."""
  found = list(adapted_kernels(model))
  if not found:
    return LoraConfig()
  return found[0][3].lora


def add_lora(model: Transformer, lora: LoraConfig, seed: int = 0) -> Transformer:
  """`model` with an adapter on every targeted kernel of every layer (B = 0: the function is unchanged).

  The model is changed in place and returned. A model that already carries
  adapters is refused (merge them first, `merge_lora`).
  """
  if not lora.enabled:
    return model
  if any(True for _ in adapted_kernels(model)):
    raise ValueError("The model already carries LoRA adapters: merge them first (merge_lora) to add new ones.")
  key = jax.random.PRNGKey(seed)
  for i, layer in enumerate(model.layers):
    for kernel in lora.targets:
      parent_name, inputs = TARGETS[kernel]
      parent = getattr(layer, parent_name)
      weight = getattr(parent, kernel)
      axes = weight.get_metadata().get("out_sharding") or (None,) * weight.ndim
      adapter = LoraAdapter(
        weight.shape[:inputs],
        weight.shape[inputs:],
        axes[:inputs],
        axes[inputs:],
        lora,
        jax.random.fold_in(key, i * len(TARGETS) + list(TARGETS).index(kernel)),
      )
      setattr(parent, kernel + SUFFIX, adapter)
  return model


def merged_weight(weight: jax.Array, adapter: LoraAdapter) -> jax.Array:
  """W + scale · A·B [*in, *out], in W's dtype (the sum taken in float32)."""
  a, b = adapter.lora_a[...], adapter.lora_b[...]
  update = jnp.tensordot(a, b, axes=1) * adapter.lora.scale
  return (weight.astype(jnp.float32) + update).astype(weight.dtype)


def merge_lora(model: Transformer) -> Transformer:
  """A model without adapters whose kernels are W + scale·A·B: the same function, no extra contractions.

  `model` itself is left as it is; the result shares its other parameters.
  """
  graphdef, state = nnx.split(model)
  merged = nnx.merge(graphdef, state)  # a new module tree over the same arrays
  for _, kernel, parent, adapter in adapted_kernels(merged):
    weight = getattr(parent, kernel)
    setattr(parent, kernel, weight.replace(merged_weight(weight[...], adapter)))
    delattr(parent, kernel + SUFFIX)
  return merged


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


def dropout_key(model: Transformer, key: jax.Array) -> jax.Array | None:
  """The adapters' dropout key of a training step whose key is `key`; None when no adapter drops out."""
  config = lora_config_of(model)
  return jax.random.fold_in(key, _DROPOUT_STREAM) if config.enabled and config.dropout > 0 else None


def abstract_lora_model(model_config: ModelConfig, lora: LoraConfig) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, state) of a model with adapters, every parameter a `jax.ShapeDtypeStruct`; nothing allocated."""
  from refusion_jax.model.transformer import Transformer

  return nnx.split(nnx.eval_shape(lambda: add_lora(Transformer(model_config, rngs=nnx.Rngs(0)), lora)))
