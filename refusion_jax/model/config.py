"""Model architecture configuration: one frozen dataclass and its named presets.

The same backbone covers three Hugging Face families, chosen by two switches:

| family | per-head q/k RMSNorm (`qk_norm`) | q/k/v bias (`qkv_bias`) |
| ------ | -------------------------------- | ----------------------- |
| Qwen3  | yes                              | no                      |
| Qwen2  | no                               | yes                     |
| Llama  | no                               | no                      |
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

from refusion_jax.model import quant
from refusion_jax.model import remat as remat_policies

Architecture = Literal["qwen3", "qwen2", "llama"]
AttentionImpl = Literal["auto", "flash", "xla", "chunked", "dot_product"]
_ATTENTION_IMPLS = ("auto", "flash", "xla", "chunked", "dot_product")
RematPolicy = Literal["none", "full", "projections", "projections_except_mlp"]  # refusion_jax.model.remat.POLICIES
RopeScaling = Literal["linear", "llama3"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and switches of a causal decoder-only transformer.

  Hashable, so it can be a static argument of `jax.jit`.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  architecture: Architecture = "qwen3"
  qk_norm: bool = True
  qkv_bias: bool = False
  tie_embeddings: bool = False
  rope_theta: float = 1_000_000.0
  # RoPE scaling, as Hugging Face's `rope_scaling`. "linear": every frequency is divided by
  # `rope_scaling_factor` (1.0: no scaling). "llama3" (Llama 3.1+): only wavelengths longer than
  # original_max_position / low_freq_factor are, those shorter than original_max_position /
  # high_freq_factor are kept, and the band between is interpolated.
  rope_scaling: RopeScaling = "linear"
  rope_scaling_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_position: int = 8192
  rms_norm_eps: float = 1e-6
  max_position_embeddings: int = 40_960
  # Special tokens; None means "not known from the checkpoint" (the decoder then
  # needs them passed explicitly).
  mask_token_id: int | None = None
  eos_token_id: int | None = None
  pad_token_id: int | None = None
  # Activations and the KV cache use `dtype`; parameters are stored in `param_dtype`.
  dtype: str = "float32"
  param_dtype: str = "float32"
  # What each decoder layer keeps for the backward pass (refusion_jax.model.remat): "none" keeps everything,
  # "full" only the layer's input (recomputes the layer), "projections" the outputs of every projection
  # (q/k/v/o and the MLP's gate/up/down; recomputes norms, RoPE, attention and activations),
  # "projections_except_mlp" those of q/k/v/o only (also recomputes the MLP). True / False (configs and
  # checkpoints written before the policies had names) mean "full" / "none".
  remat: RematPolicy = "none"
  # How attention is computed (same logits; see refusion_jax.model.transformer): "auto" runs training forwards
  # (segment ids, no mask, no cache) through the fused kernel on TPU and GPU (where jax ships it) and
  # everything else, CPU included, as "xla"; "flash" always fuses training forwards (splash attention on TPU,
  # the Pallas Triton kernel on GPU, splash interpreted on CPU: tests only); "xla" holds every
  # [heads, block, keys] score at once, "chunked" only `attention_chunk` query rows' worth, "dot_product"
  # calls jax.nn.dot_product_attention. Forwards with a mask or a cache (decoding) run "xla" under "auto"
  # and "flash".
  attention_impl: AttentionImpl = "auto"
  attention_chunk: int = 512
  # Run the decoder layers as one `lax.scan` over their weights, stacked inside the forward (one layer body
  # in the compiled forward and backward: faster compiles). Parameters stay one subtree per layer, so
  # checkpoints are the same either way; decoding always runs the layers unrolled.
  scan_layers: bool = False
  # Weight-only quantization of the projections (q/k/v/o, gate/up/down; refusion_jax.model.quant): "none",
  # "int8" (one scale per output channel) or "int4" (one per output channel and group of
  # `quantize_group_size` inputs; 0: per output channel). The embedding, norms and LM head stay float.
  quantize: str = "none"
  quantize_group_size: int = 128

  def __post_init__(self):
    if isinstance(self.remat, bool):  # the boolean of older configs and checkpoints
      object.__setattr__(self, "remat", "full" if self.remat else "none")
    if self.remat not in remat_policies.POLICIES:
      raise ValueError(
        f"remat={self.remat!r}; expected one of {tuple(remat_policies.POLICIES)} (or True / False: full / none)."
      )
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} (GQA).")
    for field in ("dtype", "param_dtype"):
      if getattr(self, field) not in _DTYPES:
        raise ValueError(f"{field}={getattr(self, field)!r}; expected one of {sorted(_DTYPES)}.")
    if self.architecture not in ("qwen3", "qwen2", "llama"):
      raise ValueError(f"architecture={self.architecture!r}; expected 'qwen3', 'qwen2' or 'llama'.")
    if self.attention_impl not in _ATTENTION_IMPLS:
      raise ValueError(f"attention_impl={self.attention_impl!r}; expected one of {_ATTENTION_IMPLS}.")
    if self.attention_chunk < 1:
      raise ValueError(f"attention_chunk={self.attention_chunk} must be at least 1 (query rows per chunk).")
    quant.check_mode(self.quantize)
    quant.check_group_size(self.quantize, self.quantize_group_size, self.projection_inputs)
    if self.rope_scaling not in ("linear", "llama3"):
      raise ValueError(f"rope_scaling={self.rope_scaling!r}; expected 'linear' or 'llama3'.")
    if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
      raise ValueError(
        f"rope_high_freq_factor={self.rope_high_freq_factor} must exceed rope_low_freq_factor="
        f"{self.rope_low_freq_factor} (llama3 RoPE interpolates between them)."
      )

  @property
  def projection_inputs(self) -> dict[str, int]:
    """The input widths of the projections (what an int4 group size must divide), by what sets them."""
    return {
      "hidden_size (q/k/v/gate/up)": self.hidden_size,
      "num_heads × head_dim (o_proj)": self.num_heads * self.head_dim,
      "intermediate_size (down_proj)": self.intermediate_size,
    }

  @property
  def compute_dtype(self) -> jnp.dtype:
    return _DTYPES[self.dtype]

  @property
  def weight_dtype(self) -> jnp.dtype:
    return _DTYPES[self.param_dtype]

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)


def family_switches(architecture: Architecture) -> dict:
  """The `qk_norm` / `qkv_bias` defaults of each family."""
  return {
    "qwen3": dict(qk_norm=True, qkv_bias=False),
    "qwen2": dict(qk_norm=False, qkv_bias=True),
    "llama": dict(qk_norm=False, qkv_bias=False),
  }[architecture]


def _build(defaults: dict, overrides: dict) -> ModelConfig:
  """`ModelConfig(**defaults)` with any field replaced by `overrides`, an unknown name refused by name."""
  unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)})
  if unknown:
    fields = ", ".join(f.name for f in dataclasses.fields(ModelConfig))
    raise ValueError(f"Unknown ModelConfig fields {unknown}; a preset takes any of: {fields}.")
  return ModelConfig(**{**defaults, **overrides})


def tiny(vocab_size: int = 256, architecture: Architecture = "qwen3", **overrides) -> ModelConfig:
  """A two-layer model for tests and CPU demos (GQA ratio 2)."""
  defaults = dict(
    vocab_size=vocab_size,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    architecture=architecture,
    max_position_embeddings=4096,
    rope_theta=10_000.0,
    **family_switches(architecture),
  )
  return _build(defaults, overrides)


def small(vocab_size: int = 512, **overrides) -> ModelConfig:
  """A ~20M-parameter Qwen3-shaped model: the largest the CPU benchmarks use."""
  defaults = dict(
    vocab_size=vocab_size,
    hidden_size=512,
    intermediate_size=1536,
    num_layers=6,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
  )
  return _build(defaults, overrides)


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tie: bool, overrides: dict) -> ModelConfig:
  """A Qwen3 size (151,936-token vocabulary, 8 KV heads of 128) with any field overridden."""
  defaults = dict(
    vocab_size=151_936,
    hidden_size=hidden,
    intermediate_size=intermediate,
    num_layers=layers,
    num_heads=heads,
    num_kv_heads=8,
    head_dim=128,
    tie_embeddings=tie,
    eos_token_id=151_645,
    pad_token_id=151_643,
  )
  return _build(defaults, overrides)


def qwen3_0p6b(**overrides) -> ModelConfig:
  return _qwen3(1024, 3072, 28, 16, True, overrides)


def qwen3_1p7b(**overrides) -> ModelConfig:
  return _qwen3(2048, 6144, 28, 16, True, overrides)


def qwen3_4b(**overrides) -> ModelConfig:
  return _qwen3(2560, 9728, 36, 32, True, overrides)


def qwen3_8b(**overrides) -> ModelConfig:
  return _qwen3(4096, 12288, 36, 32, False, overrides)


def refusion_8b(**overrides) -> ModelConfig:
  """The released ReFusion weights: Qwen3-8B with a 151,671-token vocabulary."""
  return qwen3_8b(**{"vocab_size": 151_671, **overrides})


PRESETS = {
  "tiny": tiny,
  "small": small,
  "qwen3_0p6b": qwen3_0p6b,
  "qwen3_1p7b": qwen3_1p7b,
  "qwen3_4b": qwen3_4b,
  "qwen3_8b": qwen3_8b,
  "refusion_8b": refusion_8b,
}


def preset(name: str, **overrides) -> ModelConfig:
  """Look a preset up by name; every `ModelConfig` field may be overridden, e.g. `preset("qwen3_8b", num_layers=8)`."""
  if name not in PRESETS:
    raise ValueError(f"Unknown model preset {name!r}; choose one of {sorted(PRESETS)}.")
  return PRESETS[name](**overrides)
