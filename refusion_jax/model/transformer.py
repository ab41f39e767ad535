"""The causal decoder-only transformer (Qwen3 / Qwen2 / Llama) in Flax NNX.

One forward serves training, every decode phase and the baselines: a block of
T query tokens with explicit positions and an explicit boolean attention mask,
optionally against a fixed-capacity `KVCache`. Causality comes from the mask,
never from the positions, which is what lets ReFusion store tokens out of
position order.

Every parameter carries logical axis names (`embed`, `heads`, `kv_heads`,
`head_dim`, `mlp`, `vocab`, `layers`) as metadata, and the residual stream,
attention and MLP intermediates and logits are constrained by `activation_*`
names; `refusion_jax.parallel.sharding` maps both to mesh axes (docs/method.md §5).

`config.attention_impl` picks how attention is computed (same logits):

| impl          | scores held at once                 | use                                                        |
| ------------- | ----------------------------------- | ---------------------------------------------------------- |
| `auto`        | `flash` or `xla`                    | default: `flash` for training on TPU / GPU, else `xla`     |
| `flash`       | one block of keys per query block   | training forwards (segment ids): refusion_jax.model.flash  |
| `xla`         | [batch, heads, block, keys] float32 | decoding, short sequences, CPU training                    |
| `chunked`     | [batch, heads, chunk, keys] float32 | long-sequence training without a fused kernel (chunks remat'd) |
| `dot_product` | as `xla` on CPU and TPU             | `jax.nn.dot_product_attention` (backends it fuses on)      |

Forwards with a mask or a cache (every decode forward) run `xla` under `auto`
and `flash`: the fused kernels know segments, not arbitrary masks.

`config.remat` names what each layer keeps for the backward pass
(refusion_jax.model.remat); `config.scan_layers` runs the layers as one
`lax.scan` over their weights stacked inside the forward (the parameter tree
stays one subtree per layer, so checkpoints and shardings do not change).

Any projection may carry a LoRA adapter beside its kernel (refusion_jax.model.adapter):
its output is then `x·W + scale·(x·A)·B`, named as the projection's for remat.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from refusion_jax.model import adapter, quant, remat
from refusion_jax.model.cache import BlockKV, KVCache, block_mask
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.flash import Segments, attend_segments, auto_uses_kernel, target_platform
from refusion_jax.parallel.activations import constrain

# Large negative instead of -inf: a fully masked query row (padding, finished
# decode rows) then gives a harmless uniform average rather than NaN.
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)

KV = tuple[jax.Array, jax.Array]  # one layer's keys and values, each [batch, length, kv_heads, head_dim]

# Logical axes of the activations (see refusion_jax.parallel.sharding.LOGICAL_AXIS_RULES).
_RESIDUAL = ("activation_batch", "activation_length", "activation_embed")
_HEADS = ("activation_batch", "activation_length", "activation_heads", "activation_head_dim")
_KV = ("activation_batch", "activation_length", "activation_kv_heads", "activation_head_dim")
# Grouped queries [batch, length, kv_heads, groups, head_dim]; scores [batch, kv_heads, groups, length, keys].
_GROUPED = ("activation_batch", "activation_length", "activation_kv_heads", None, "activation_head_dim")
_SCORES = ("activation_batch", "activation_kv_heads", None, "activation_length", None)
_MLP = ("activation_batch", "activation_length", "activation_mlp")
_LOGITS = ("activation_batch", "activation_length", "activation_vocab")


def _param(rngs: nnx.Rngs, shape, axes, config: ModelConfig, init=None) -> nnx.Param:
  init = init or nnx.initializers.normal(0.02)
  value = init(rngs.params(), shape, config.weight_dtype)
  return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _add_projection(module: nnx.Module, name: str, rngs: nnx.Rngs, shape, axes, config: ModelConfig) -> None:
  """Set `module.<name>`, a projection kernel: float, or under `config.quantize` an integer kernel and its
  scale `module.<name>_scale` (refusion_jax.model.quant; what a random init quantizes to)."""
  kernel = _param(rngs, shape, axes, config)
  if config.quantize != "none":
    inputs = adapter.TARGETS[name][1]
    q, scale = quant.quantize_kernel(kernel[...], inputs, config.quantize, config.quantize_group_size)
    setattr(module, name + quant.SCALE_SUFFIX, quant.scale_param(scale, kernel, inputs))
    kernel = kernel.replace(q)
  setattr(module, name, kernel)


class RMSNorm(nnx.Module):
  """Root-mean-square norm over the last axis, computed in float32."""

  def __init__(self, dim: int, axis_name: str, config: ModelConfig, rngs: nnx.Rngs):
    self.weight = _param(rngs, (dim,), (axis_name,), config, nnx.initializers.ones)
    self.eps = config.rms_norm_eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.weight[...].astype(x.dtype) * normed.astype(x.dtype)


def rope_frequencies(config: ModelConfig) -> jax.Array:
  """[head_dim // 2] inverse wavelengths (radians per position) of the rotary embedding.

  Scaled as Hugging Face's `rope_scaling` says (see `ModelConfig.rope_scaling`); the
  llama3 rule is transformers' `_compute_llama3_parameters`.
  """
  c = config
  inv_freq = 1.0 / (c.rope_theta ** (jnp.arange(0, c.head_dim, 2, dtype=jnp.float32) / c.head_dim))
  if c.rope_scaling == "linear":
    return inv_freq / c.rope_scaling_factor
  wavelength = 2 * jnp.pi / inv_freq
  context = c.rope_original_max_position
  # 0 at the long-wavelength edge of the band (fully scaled), 1 at the short one (kept).
  blend = (context / wavelength - c.rope_low_freq_factor) / (c.rope_high_freq_factor - c.rope_low_freq_factor)
  blend = jnp.clip(blend, 0.0, 1.0)
  return (1 - blend) * inv_freq / c.rope_scaling_factor + blend * inv_freq


def rope(x: jax.Array, positions: jax.Array, config: ModelConfig) -> jax.Array:
  """Rotary embedding in the Hugging Face "rotate half" layout.

  Args:
    x: [batch, length, heads, head_dim].
    positions: [batch, length] true positions.
  """
  angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(config)  # [B, T, D/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x32 = x.astype(jnp.float32)
  first, second = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-second, first], axis=-1)
  return (x32 * cos + rotated * sin).astype(x.dtype)


class Attention(nnx.Module):
  """Grouped-query attention against an optional cache, with an explicit mask."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    c = config
    self.config = config
    _add_projection(self, "q_proj", rngs, (c.hidden_size, c.num_heads, c.head_dim), ("embed", "heads", "head_dim"), c)
    kv_shape, kv_axes = (c.hidden_size, c.num_kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim")
    _add_projection(self, "k_proj", rngs, kv_shape, kv_axes, c)
    _add_projection(self, "v_proj", rngs, kv_shape, kv_axes, c)
    _add_projection(self, "o_proj", rngs, (c.num_heads, c.head_dim, c.hidden_size), ("heads", "head_dim", "embed"), c)
    if c.qkv_bias:
      zeros = nnx.initializers.zeros
      self.q_bias = _param(rngs, (c.num_heads, c.head_dim), ("heads", "head_dim"), c, zeros)
      self.k_bias = _param(rngs, (c.num_kv_heads, c.head_dim), ("kv_heads", "head_dim"), c, zeros)
      self.v_bias = _param(rngs, (c.num_kv_heads, c.head_dim), ("kv_heads", "head_dim"), c, zeros)
    if c.qk_norm:
      self.q_norm = RMSNorm(c.head_dim, "head_dim", c, rngs)
      self.k_norm = RMSNorm(c.head_dim, "head_dim", c, rngs)

  def _project(self, x, kernel, bias_name, name, dropout_key):
    out = quant.project(self, kernel, x, 1) + adapter.delta(self, kernel, x, dropout_key)
    if self.config.qkv_bias:
      out = out + getattr(self, bias_name)[...].astype(x.dtype)
    return checkpoint_name(out, name)

  def __call__(
    self,
    x: jax.Array,
    positions: jax.Array,
    mask: jax.Array | Segments,
    cached: tuple[jax.Array, jax.Array] | None,
    dropout_key: jax.Array | None = None,
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Attend the block to the cache and to itself.

    Args:
      x: [batch, block, embed].
      positions: [batch, block].
      mask: [batch, block, capacity + block] (or [batch, block, block] without a cache), or the
        `Segments` of a training forward for the fused kernel (no cache).
      cached: this layer's cache keys and values, each [batch, capacity, kv_heads, head_dim].
      dropout_key: the key of the LoRA adapters' dropout (training); None: no dropout.

    Returns:
      The attention output [batch, block, embed] and the block's own keys and
      values after RoPE, each [batch, block, kv_heads, head_dim].
    """
    c = self.config
    q = self._project(x, "q_proj", "q_bias", remat.Q_PROJ, dropout_key)
    k = self._project(x, "k_proj", "k_bias", remat.K_PROJ, dropout_key)
    v = self._project(x, "v_proj", "v_bias", remat.V_PROJ, dropout_key)
    if c.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = rope(q, positions, c)
    k = rope(k, positions, c)

    q, k, v = constrain(q, _HEADS), constrain(k, _KV), constrain(v, _KV)

    batch, block = x.shape[:2]
    groups = c.num_heads // c.num_kv_heads
    q = q.reshape(batch, block, c.num_kv_heads, groups, c.head_dim) * (c.head_dim**-0.5)
    if isinstance(mask, Segments):
      out = attend_segments(q, k, v, mask)
    else:
      chunked = functools.partial(attend_chunked, chunk=c.attention_chunk)
      attend = {"chunked": chunked, "dot_product": attend_dot_product}.get(c.attention_impl, attend_dense)
      out = attend(q, k, v, cached, mask)
    out = constrain(out.reshape(batch, block, c.num_heads, c.head_dim), _HEADS)
    projected = quant.project(self, "o_proj", out, 2)
    out = checkpoint_name(projected + adapter.delta(self, "o_proj", out, dropout_key), remat.O_PROJ)
    return constrain(out, _RESIDUAL), (k, v)


def attend_dense(q: jax.Array, k: jax.Array, v: jax.Array, cached: KV | None, mask: jax.Array) -> jax.Array:
  """Softmax attention of a query block to the cache and the block's own keys, all scores at once.

  Args:
    q: [batch, queries, kv_heads, groups, head_dim], already scaled by head_dim^-0.5.
    k, v: the block's keys and values [batch, block, kv_heads, head_dim].
    cached: the cache's keys and values, each [batch, capacity, kv_heads, head_dim], or None.
    mask: [batch, queries, capacity + block] bool (cache entries first).

  Returns:
    [batch, queries, kv_heads, groups, head_dim] in q's dtype.
  """
  # Scores against the cache and against the block are computed apart and
  # joined only as scores, so the cache itself is never concatenated.
  scores = [jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)]
  if cached is not None:
    cache_k, cache_v = cached
    scores.insert(0, jnp.einsum("btkgd,bskd->bkgts", q, cache_k, preferred_element_type=jnp.float32))
  scores = constrain(jnp.concatenate(scores, axis=-1), _SCORES)
  scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)

  block = k.shape[1]
  out = jnp.einsum("bkgts,bskd->btkgd", probs[..., -block:], v)
  if cached is not None:
    out = out + jnp.einsum("bkgts,bskd->btkgd", probs[..., :-block], cache_v)
  return constrain(out, _GROUPED)


def attend_chunked(
  q: jax.Array, k: jax.Array, v: jax.Array, cached: KV | None, mask: jax.Array, *, chunk: int
) -> jax.Array:
  """`attend_dense` over `chunk` queries at a time, each chunk rematerialised in the backward pass.

  Only one chunk's scores [batch, heads, chunk, keys] exist at once, forward
  and backward, instead of [batch, heads, queries, keys]: what lets 4096-token
  training fit. Rows are independent, so the result is the dense one. Shapes
  as in `attend_dense`; queries are padded up to a multiple of `chunk`.
  """
  queries = q.shape[1]
  if queries <= chunk:
    return attend_dense(q, k, v, cached, mask)
  pad = -queries % chunk
  q = jnp.pad(q, [(0, 0), (0, pad)] + [(0, 0)] * 3)
  mask = jnp.pad(mask, [(0, 0), (0, pad), (0, 0)])  # padded queries see nothing and are dropped below

  def split(x):  # [batch, queries, ...] -> [queries / chunk, batch, chunk, ...]
    return jnp.moveaxis(x.reshape(x.shape[0], -1, chunk, *x.shape[2:]), 1, 0)

  # prevent_cse=False: inside a scan, CSE cannot undo the rematerialisation.
  one_chunk = jax.checkpoint(lambda qm: attend_dense(qm[0], k, v, cached, qm[1]), prevent_cse=False)
  out = jax.lax.map(one_chunk, (split(q), split(mask)))  # [chunks, batch, chunk, kv_heads, groups, head_dim]
  out = jnp.moveaxis(out, 0, 1).reshape(q.shape)
  return out[:, :queries]


def attend_dot_product(q: jax.Array, k: jax.Array, v: jax.Array, cached: KV | None, mask: jax.Array) -> jax.Array:
  """`jax.nn.dot_product_attention` with the explicit mask; shapes as in `attend_dense`.

  It takes one key sequence, so the cache and the block's keys are joined (a
  copy of the layer's cache per forward).
  """
  batch, queries, kv_heads, groups, head_dim = q.shape
  if cached is not None:
    k, v = (jnp.concatenate([entries, new], axis=1) for entries, new in zip(cached, (k, v)))
  grouped = q.reshape(batch, queries, kv_heads * groups, head_dim)  # query head h uses KV head h // groups
  out = jax.nn.dot_product_attention(grouped, k, v, mask=mask[:, None], scale=1.0)
  return constrain(out.reshape(q.shape), _GROUPED)


class MLP(nnx.Module):
  """SwiGLU feed-forward."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    c = config
    _add_projection(self, "gate_proj", rngs, (c.hidden_size, c.intermediate_size), ("embed", "mlp"), c)
    _add_projection(self, "up_proj", rngs, (c.hidden_size, c.intermediate_size), ("embed", "mlp"), c)
    _add_projection(self, "down_proj", rngs, (c.intermediate_size, c.hidden_size), ("mlp", "embed"), c)

  def _project(self, x: jax.Array, kernel: str, name: str, dropout_key: jax.Array | None) -> jax.Array:
    out = quant.project(self, kernel, x, 1) + adapter.delta(self, kernel, x, dropout_key)
    return checkpoint_name(out, name)

  def __call__(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
    gate = constrain(self._project(x, "gate_proj", remat.MLP_GATE, dropout_key), _MLP)
    up = constrain(self._project(x, "up_proj", remat.MLP_UP, dropout_key), _MLP)
    down = self._project(jax.nn.silu(gate) * up, "down_proj", remat.MLP_DOWN, dropout_key)
    return constrain(down, _RESIDUAL)


class DecoderLayer(nnx.Module):
  """Pre-norm attention block followed by a pre-norm MLP block."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(config.hidden_size, "embed", config, rngs)
    self.self_attn = Attention(config, rngs)
    self.post_attention_layernorm = RMSNorm(config.hidden_size, "embed", config, rngs)
    self.mlp = MLP(config, rngs)

  def __call__(self, x, positions, mask, cached, dropout_key=None):
    attn_key, mlp_key = (None, None) if dropout_key is None else jax.random.split(dropout_key)
    attn_out, kv = self.self_attn(self.input_layernorm(x), positions, mask, cached, attn_key)
    x = constrain(x + attn_out, _RESIDUAL)
    x = constrain(x + self.mlp(self.post_attention_layernorm(x), mlp_key), _RESIDUAL)
    return x, kv


def uses_fused_attention(attention_impl: str) -> bool:
  """Whether a training forward (segment ids) runs the fused kernel: "flash" always, "auto" off the CPU where
  the platform's kernel is installed (refusion_jax.model.flash.auto_uses_kernel)."""
  if attention_impl != "auto":
    return attention_impl == "flash"
  return auto_uses_kernel(target_platform())


def run_layers(
  layers: Sequence[DecoderLayer],
  x: jax.Array,
  positions: jax.Array,
  attention: jax.Array | Segments,
  cache: KVCache | None,
  config: ModelConfig,
  dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, BlockKV]:
  """The decoder layers over the residual stream, under `config.remat` and `config.scan_layers`.

  Args:
    x: [batch, block, embed] embedded tokens.
    positions, attention, cache: as `DecoderLayer` takes them (the cache split per layer).
    dropout_key: the LoRA adapters' dropout key (layer i draws from fold_in(key, i)); None: no dropout.

  Returns:
    The last layer's output [batch, block, embed] and every layer's keys and values.

  Scanned, the layers' floating weights are stacked inside the forward
  ([layers, ...], cast to the compute dtype first, as each layer would cast them
  anyway, so the results match the unrolled loop's): the compiled program holds
  one layer, at the cost of one stacked copy of those weights in the compute
  dtype (sharded like the weights). Integer (quantized) kernels are not stacked:
  frozen and the bulk of a quantized model, their stacked copy would take back
  much of what quantizing saved (7 GB of an int8 Qwen3-8B's 9.4), so each layer
  picks its own by index (`_one_layer`).
  """
  policy = remat.POLICIES[config.remat]
  graphdef = nnx.graphdef(layers[0])  # every layer has the same structure
  caches = (None, None) if cache is None else (cache.k, cache.v)
  layer_keys = [None if dropout_key is None else jax.random.fold_in(dropout_key, i) for i in range(len(layers))]
  if not config.scan_layers:
    one_layer = _one_layer(graphdef, policy, positions, attention, prevent_cse=True)
    keys, values = [], []
    for i, layer in enumerate(layers):
      cached = None if cache is None else (cache.k[i], cache.v[i])
      if policy is None:
        x, (k, v) = layer(x, positions, attention, cached, layer_keys[i])
      else:
        x, (k, v) = one_layer(nnx.state(layer), None, x, cached, layer_keys[i])
      keys.append(k)
      values.append(v)
    return x, BlockKV(k=jnp.stack(keys), v=jnp.stack(values))

  states = [nnx.split_state(nnx.state(layer), _is_integer, ...) for layer in layers]
  integers = [integer for integer, _ in states] if jax.tree.leaves(states[0][0]) else None
  stacked = _stacked_weights([rest for _, rest in states], config)
  # Inside a scan, CSE cannot undo the rematerialisation (prevent_cse=False is then safe and faster).
  one_layer = _one_layer(graphdef, policy, positions, attention, prevent_cse=False, integers=integers)

  def body(x, per_layer):
    state, index, cache_k, cache_v, key = per_layer
    return one_layer(state, index, x, None if cache_k is None else (cache_k, cache_v), key)

  stacked_keys = None if dropout_key is None else jnp.stack(layer_keys)
  indices = None if integers is None else jnp.arange(len(layers), dtype=jnp.int32)
  x, (keys, values) = jax.lax.scan(body, x, (stacked, indices, *caches, stacked_keys))
  return x, BlockKV(k=keys, v=values)


def _one_layer(
  graphdef: nnx.GraphDef,
  policy: Any,
  positions: jax.Array,
  attention: jax.Array | Segments,
  *,
  prevent_cse: bool,
  integers: list[nnx.State] | None = None,
) -> Callable:
  """One layer as a function (state, index, x, cached, key) -> (x, (k, v)), rematerialised under `policy`
  (None: not).

  With `integers` (every layer's integer kernels, scanned), `state` lacks them and the layer's own are picked by
  its `index` (`lax.switch`: one layer's read, no stacked copy) inside the rematerialised call, so that the
  backward pass keeps the index of a layer, not kernels that a scan would stack again as residuals. Without,
  `state` is the whole layer's and `index` None.
  """

  def one_layer(state, index, x, cached, key):
    if integers is not None:
      branches = [lambda kernels=kernels: kernels for kernels in integers]
      state = nnx.merge_state(state, jax.lax.switch(index, branches))
    return nnx.merge(graphdef, state)(x, positions, attention, cached, key)

  return one_layer if policy is None else jax.checkpoint(one_layer, policy=policy, prevent_cse=prevent_cse)


def _is_integer(path: tuple, variable: nnx.Variable) -> bool:
  del path
  return jnp.issubdtype(variable.get_value().dtype, jnp.integer)


def _stacked_weights(states: list[nnx.State], config: ModelConfig) -> nnx.State:
  """The layers' states stacked along a leading `layers` axis, floating weights in the compute dtype."""

  def stack(*variables: nnx.Variable) -> nnx.Variable:
    values = [v.get_value() for v in variables]
    if jnp.issubdtype(values[0].dtype, jnp.floating):
      values = [value.astype(config.compute_dtype) for value in values]
    axes = variables[0].get_metadata().get("out_sharding") or (None,) * values[0].ndim
    return variables[0].replace(constrain(jnp.stack(values), ("layers", *axes)))

  return jax.tree.map(stack, *states, is_leaf=lambda x: isinstance(x, nnx.Variable))


def causal_mask(batch: int, length: int) -> jax.Array:
  """[batch, length, length] lower-triangular mask."""
  tri = jnp.tril(jnp.ones((length, length), bool))
  return jnp.broadcast_to(tri, (batch, length, length))


class Transformer(nnx.Module):
  """Token embedding, decoder layers, final norm and LM head."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    quant.check_backend(c.quantize)  # int4 where the backend cannot contract it: refused before anything compiles
    self.config = config
    self.embed_tokens = _param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "embed"), c)
    self.layers = nnx.List([DecoderLayer(c, rngs) for _ in range(c.num_layers)])
    self.norm = RMSNorm(c.hidden_size, "embed", c, rngs)
    if not c.tie_embeddings:
      self.lm_head = _param(rngs, (c.hidden_size, c.vocab_size), ("embed", "vocab"), c)

  def __call__(
    self,
    tokens: jax.Array,
    positions: jax.Array | None = None,
    mask: jax.Array | None = None,
    cache: KVCache | None = None,
    *,
    segment_ids: jax.Array | None = None,
    bidirectional: bool = False,
    dropout_key: jax.Array | None = None,
  ) -> tuple[jax.Array, BlockKV]:
    """Forward a block of tokens: `features` then `logits` (arguments as in `features`).

    Returns:
      logits [batch, block, vocab] in float32, and the block's keys and values
      `BlockKV` ([layers, batch, block, kv_heads, head_dim]).
    """
    hidden, kv = self.features(
      tokens, positions, mask, cache, segment_ids=segment_ids, bidirectional=bidirectional, dropout_key=dropout_key
    )
    return self.logits(hidden), kv

  def features(
    self,
    tokens: jax.Array,
    positions: jax.Array | None = None,
    mask: jax.Array | None = None,
    cache: KVCache | None = None,
    *,
    segment_ids: jax.Array | None = None,
    bidirectional: bool = False,
    dropout_key: jax.Array | None = None,
  ) -> tuple[jax.Array, BlockKV]:
    """The final-normed hidden states of a block of tokens (everything but the LM head).

    Args:
      tokens: [batch, block] int token ids.
      positions: [batch, block] true RoPE positions; defaults to 0..block-1.
      mask: [batch, block, capacity + block] bool with a cache, [batch, block,
        block] without; entry [b, i, j] says whether query i sees key j (cache
        entries first, then the block). Defaults to causal over the block (and
        every valid cache entry), or to `segment_ids`' mask.
      cache: an optional `KVCache` the block attends to. It is only read; use
        `refusion_jax.model.cache.append` / `write` to store the returned keys.
      segment_ids: [batch, block] int, the training layout of packed rows (no
        cache, no mask): a token sees only tokens of its own segment, the
        earlier ones (or, with `bidirectional`, all of them). Id 0 marks padding.
      bidirectional: with `segment_ids`, attention is full within a segment (the MDM baseline).
      dropout_key: where LoRA adapters with dropout draw it (training forwards); None: no dropout.

    Returns:
      hidden [batch, block, embed] in the compute dtype, and the block's keys
      and values `BlockKV` ([layers, batch, block, kv_heads, head_dim]).
    """
    c = self.config
    chex.assert_rank(tokens, 2)
    batch, block = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(block, dtype=jnp.int32), (batch, block))
    attention = mask
    if segment_ids is not None:
      if mask is not None or cache is not None:
        raise ValueError("segment_ids describe the attention of a training forward: pass no mask and no cache.")
      chex.assert_shape(segment_ids, (batch, block))
      chex.assert_type(segment_ids, int)
      if uses_fused_attention(c.attention_impl):
        attention = Segments(segment_ids, bidirectional)  # the kernel masks by segment: no [B, T, T] mask
      else:
        attention = segment_mask(segment_ids, bidirectional)
    if attention is None:
      attention = causal_mask(batch, block)
      if cache is not None:
        attention = block_mask(cache, attention)
    chex.assert_shape(positions, (batch, block))
    chex.assert_type([tokens, positions], [int, int])
    if not isinstance(attention, Segments):
      chex.assert_shape(attention, (batch, block, block if cache is None else cache.capacity + block))
      chex.assert_type(attention, bool)

    # The lookup reads a table whole along `embed` (cast first: half the bytes to gather). Rows gathered
    # from a table split along `embed` stay split that way, and XLA can turn them into batch-split rows
    # only by replicating them first.
    table = constrain(self.embed_tokens[...].astype(c.compute_dtype), ("vocab", None))
    x = constrain(table[tokens], _RESIDUAL)
    x, kv = run_layers(self.layers, x, positions, attention, cache, c, dropout_key)
    return self.norm(x), kv

  def head_matrix(self) -> jax.Array:
    """The LM head [embed, vocab] in the compute dtype (the embedding's transpose when tied)."""
    head = self.embed_tokens[...].T if self.config.tie_embeddings else self.lm_head[...]
    return head.astype(self.config.compute_dtype)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """[batch, length, embed] final-normed hidden states -> [batch, length, vocab] float32 logits."""
    logits = jnp.einsum("bte,ev->btv", hidden, self.head_matrix(), preferred_element_type=jnp.float32)
    return constrain(logits, _LOGITS)


def segment_mask(segment_ids: jax.Array, bidirectional: bool = False) -> jax.Array:
  """[batch, length, length] bool: query i sees key j of the same segment, j <= i unless `bidirectional`.

  Args:
    segment_ids: [batch, length] int (0 = padding, which then sees only padding).
  """
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  if bidirectional:
    return same
  length = segment_ids.shape[1]
  return same & jnp.tril(jnp.ones((length, length), bool))[None]


def init_model(config: ModelConfig, seed: int = 0) -> Transformer:
  """A randomly initialised model."""
  return Transformer(config, rngs=nnx.Rngs(params=seed))


def abstract_model(config: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, state) of a model whose parameters are `jax.ShapeDtypeStruct`s (shapes, dtypes, logical axes).

  Nothing is allocated or initialised: loaders fill the state from a checkpoint.
  """
  return nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))


def inference_view(model: Transformer) -> Transformer:
  """The model as every decoder must run it: no remat, layers unrolled, weights already in the compute dtype.

  Remat only pays off where gradients are taken, and scanned layers would
  stack the weights again in every decode forward (see `inference_config`). Weights
  stored wider than the compute dtype (float32 master weights, bfloat16
  compute) are cast here, once: a jitted decoder that received them as
  float32 would hold a cast copy of every weight for each call. Hold on to the
  view to pay the cast once (the `Sampler` does); a view of a view, or of a
  model that needs no change, is the model itself.

  The view shares every parameter array with `model` when no cast is needed
  (no copy), and keeps each array's sharding and logical axes either way.
  Updating `model` afterwards does not update a cast view.
  """
  config = model.config
  view_config = inference_config(config)
  if view_config == config:
    return model
  graphdef, state = nnx.split(model)
  if view_config.weight_dtype != config.weight_dtype:
    state = jax.tree.map(lambda x: x.astype(config.compute_dtype) if x.dtype == config.weight_dtype else x, state)
  return with_config(nnx.merge(graphdef, state), view_config)


def with_config(model: Transformer, config: ModelConfig) -> Transformer:
  """`model` (changed in place) with `config` on every module that holds its config.

  The config is a static attribute of the modules that read it at call time; whoever changes what the
  parameters are (a dtype, quantized kernels) gives the modules the config that says so.
  """
  old = model.config
  for _, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Module) and getattr(node, "config", None) == old:
      node.config = config
  return model


def inference_config(config: ModelConfig) -> ModelConfig:
  """The config of `inference_view`: remat off, layers unrolled, and weights wider than the compute dtype stored in it.

  Weights narrower than the compute dtype stay as they are (casting them up
  once would only take more memory). Scanned layers would stack the weights
  again in every forward of a decode loop; unrolled, a decode forward reads
  them where they are.
  """
  narrower = jnp.dtype(config.compute_dtype).itemsize < jnp.dtype(config.weight_dtype).itemsize
  return config.replace(remat="none", scan_layers=False, param_dtype=config.dtype if narrower else config.param_dtype)
