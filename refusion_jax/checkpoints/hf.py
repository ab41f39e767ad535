"""Hugging Face checkpoints (config.json + safetensors) to and from our `Transformer`.

One table, `TABLE`, says which Hugging Face tensor becomes which NNX
parameter, what its axes mean and how its layout changes. Loading reads the
table from the Hugging Face side, saving from ours, so the two directions
cannot drift.

Loading (`refusion_jax.checkpoints.load.load_model`, format "hf") never holds
two copies of the model: the module is built abstractly and its parameters
are filled one tensor at a time, each placed straight onto its target sharding
(`refusion_jax.checkpoints.restore`). Anything that does not fit (an unmapped
tensor, a shape that disagrees with config.json, a parameter left unfilled, a
truncated file) is an error naming the culprit.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from refusion_jax.checkpoints.mapping import Rule, Table, split_heads
from refusion_jax.checkpoints.restore import Fetch, Source, dotted
from refusion_jax.data.special_tokens import discover_special_tokens, first_id
from refusion_jax.model import lora
from refusion_jax.model import quantize as quantize_lib
from refusion_jax.model.config import ModelConfig, family_switches
from refusion_jax.model.transformer import Transformer

# Hugging Face class name of each family we load and save.
_HF_CLASSES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"

# --------------------------------------------------------------------------
# The name and layout table.
#
# Hugging Face linear weights are [out_features, in_features] with the heads
# fused into one axis; ours put the input axis first and keep heads apart,
# e.g. q_proj [embed, heads, head_dim], o_proj [heads, head_dim, embed]. Each
# layout is a pair of conversions (to ours, back to Hugging Face) that work on
# numpy and jax arrays alike.


def _linear_input_first(x, shape):
  """q/k/v [embed, heads, head_dim], gate/up [embed, mlp], lm_head [embed, vocab] from [out, in]."""
  return x.T.reshape(shape)


def _linear_output_last(x, shape):
  """o_proj [heads, head_dim, embed], down_proj [mlp, embed] from [out, in]."""
  return x.T.reshape(shape)


_TO_HF = {
  None: lambda y: y,
  _linear_input_first: lambda y: y.reshape(y.shape[0], -1).T,
  _linear_output_last: lambda y: y.reshape(-1, y.shape[-1]).T,
  split_heads: lambda y: y.reshape(-1),
}

# Every tensor of the three families; anything else in a checkpoint is an error.
_LAYER = "model.layers.{layer}."
TABLE = Table(
  [
    Rule("model.embed_tokens.weight", "embed_tokens", ("vocab", "embed")),
    Rule("model.norm.weight", "norm.weight", ("embed",)),
    Rule("lm_head.weight", "lm_head", ("vocab", "embed"), _linear_input_first),
    Rule(_LAYER + "input_layernorm.weight", "layers.{layer}.input_layernorm.weight", ("embed",)),
    Rule(_LAYER + "post_attention_layernorm.weight", "layers.{layer}.post_attention_layernorm.weight", ("embed",)),
    Rule(
      _LAYER + "self_attn.q_proj.weight",
      "layers.{layer}.self_attn.q_proj",
      ("heads*head_dim", "embed"),
      _linear_input_first,
    ),
    Rule(
      _LAYER + "self_attn.{kv}_proj.weight",
      "layers.{layer}.self_attn.{kv}_proj",
      ("kv_heads*head_dim", "embed"),
      _linear_input_first,
    ),
    Rule(_LAYER + "self_attn.q_proj.bias", "layers.{layer}.self_attn.q_bias", ("heads*head_dim",), split_heads),
    Rule(
      _LAYER + "self_attn.{kv}_proj.bias", "layers.{layer}.self_attn.{kv}_bias", ("kv_heads*head_dim",), split_heads
    ),
    Rule(
      _LAYER + "self_attn.o_proj.weight",
      "layers.{layer}.self_attn.o_proj",
      ("embed", "heads*head_dim"),
      _linear_output_last,
    ),
    Rule(_LAYER + "self_attn.{qk}_norm.weight", "layers.{layer}.self_attn.{qk}_norm.weight", ("head_dim",)),
    Rule(
      _LAYER + "mlp.{gate_up}_proj.weight", "layers.{layer}.mlp.{gate_up}_proj", ("mlp", "embed"), _linear_input_first
    ),
    Rule(_LAYER + "mlp.down_proj.weight", "layers.{layer}.mlp.down_proj", ("embed", "mlp"), _linear_output_last),
  ]
)


# --------------------------------------------------------------------------
# config.json


def _architecture(hf_config: dict) -> str:
  supported = f"supported: {sorted(_HF_CLASSES.values())} (model_type {sorted(_HF_CLASSES)})"
  names = hf_config.get("architectures") or []
  families = {hf_class: family for family, hf_class in _HF_CLASSES.items()}
  for name in names:
    if name in families:
      return families[name]
  if names:
    raise ValueError(
      f"Unsupported architecture {names} in config.json; {supported}. If the checkpoint is one of these "
      'under another class name, set "architectures" in its config.json.'
    )
  model_type = hf_config.get("model_type")
  if model_type in _HF_CLASSES:
    return model_type
  raise ValueError(f"Unsupported model_type {model_type!r} in config.json (no architectures given); {supported}.")


def _single_rope_dict(value: dict | None) -> dict:
  """A rope settings dict; transformers 5 may nest one per layer type."""
  if not value:
    return {}
  if all(isinstance(v, dict) for v in value.values()):
    distinct = {json.dumps(v, sort_keys=True) for v in value.values()}
    if len(distinct) > 1:
      raise NotImplementedError(f"Per-layer-type RoPE settings {value} are not supported; all layers share one RoPE.")
    return next(iter(value.values()))
  return value


def _rope(hf_config: dict) -> dict:
  """`ModelConfig` RoPE fields from either the transformers 4 or 5 layout."""
  # transformers 5 writes `rope_parameters` (theta inside); 4 writes `rope_theta` + `rope_scaling`.
  # As in transformers 5, a `rope_scaling` entry replaces `rope_parameters` but may lack the theta.
  parameters = _single_rope_dict(hf_config.get("rope_parameters"))
  settings = _single_rope_dict(hf_config.get("rope_scaling")) or parameters
  theta = float(settings.get("rope_theta", parameters.get("rope_theta", hf_config.get("rope_theta", 10_000.0))))
  partial = settings.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
  if partial != 1.0:
    raise NotImplementedError(f"partial_rotary_factor={partial} is not supported; RoPE covers the whole head.")
  rope_type = settings.get("rope_type", settings.get("type", "default"))
  if rope_type == "default":
    return dict(rope_theta=theta)
  if rope_type == "linear":
    return dict(rope_theta=theta, rope_scaling_factor=float(settings["factor"]))
  if rope_type == "llama3":
    return dict(
      rope_theta=theta,
      rope_scaling="llama3",
      rope_scaling_factor=float(settings["factor"]),
      rope_low_freq_factor=float(settings["low_freq_factor"]),
      rope_high_freq_factor=float(settings["high_freq_factor"]),
      rope_original_max_position=int(settings["original_max_position_embeddings"]),
    )
  raise NotImplementedError(
    f"RoPE scaling type {rope_type!r} is not supported; 'default', 'linear' and 'llama3' are implemented."
  )


def _rope_to_hf(config: ModelConfig) -> dict | None:
  """The `rope_scaling` entry of `config` (None: unscaled)."""
  if config.rope_scaling == "llama3":
    return dict(
      rope_type="llama3",
      factor=config.rope_scaling_factor,
      low_freq_factor=config.rope_low_freq_factor,
      high_freq_factor=config.rope_high_freq_factor,
      original_max_position_embeddings=config.rope_original_max_position,
    )
  if config.rope_scaling_factor != 1.0:
    return {"rope_type": "linear", "type": "linear", "factor": config.rope_scaling_factor}
  return None


def _check_supported_features(hf_config: dict, family: str) -> None:
  act = hf_config.get("hidden_act", "silu")
  if act != "silu":
    raise NotImplementedError(f"hidden_act={act!r} is not supported; the MLP is SwiGLU (silu).")
  if hf_config.get("use_sliding_window"):
    raise NotImplementedError("use_sliding_window=true is not supported; attention is global.")
  if hf_config.get("mlp_bias"):
    raise NotImplementedError("mlp_bias=true is not supported; the MLP has no biases.")
  if family != "qwen2" and hf_config.get("attention_bias"):
    # In Qwen3 and Llama this flag also gives o_proj a bias, which the backbone lacks.
    raise NotImplementedError(f"attention_bias=true is not supported for {family}: it adds an o_proj bias.")


def config_from_hf(hf_config: dict, **overrides) -> ModelConfig:
  """Map a Hugging Face config.json (as a dict) to a `ModelConfig`.

  Args:
    hf_config: the parsed config.json of a Qwen3ForCausalLM, Qwen2ForCausalLM or
      LlamaForCausalLM checkpoint. A `mask_token_id` key, if present, is kept.
    **overrides: `ModelConfig` fields that replace the mapped ones (e.g.
      dtype="bfloat16").
  """
  family = _architecture(hf_config)
  _check_supported_features(hf_config, family)
  missing = [
    key
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if key not in hf_config
  ]
  if missing:
    raise ValueError(f"config.json lacks the required fields {missing}.")
  heads = hf_config["num_attention_heads"]
  fields = dict(
    vocab_size=hf_config["vocab_size"],
    hidden_size=hf_config["hidden_size"],
    intermediate_size=hf_config["intermediate_size"],
    num_layers=hf_config["num_hidden_layers"],
    num_heads=heads,
    num_kv_heads=hf_config.get("num_key_value_heads") or heads,
    head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // heads,
    architecture=family,
    tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
    **_rope(hf_config),
    rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
    max_position_embeddings=hf_config.get("max_position_embeddings", 32_768),
    mask_token_id=hf_config.get("mask_token_id"),
    eos_token_id=first_id(hf_config.get("eos_token_id")),
    pad_token_id=first_id(hf_config.get("pad_token_id")),
    **family_switches(family),
  )
  fields.update(overrides)
  return ModelConfig(**fields)


def config_to_hf(config: ModelConfig) -> dict:
  """The config.json that makes transformers build the same model.

  RoPE settings are written both in the transformers 5 layout
  (`rope_parameters`) and the older one (`rope_theta`, `rope_scaling`).
  """
  if (config.qk_norm, config.qkv_bias) != tuple(family_switches(config.architecture).values()):
    raise ValueError(
      f"qk_norm={config.qk_norm}, qkv_bias={config.qkv_bias} do not match any Hugging Face {config.architecture} "
      f"model ({family_switches(config.architecture)}); such a model cannot be saved in that format."
    )
  scaling = _rope_to_hf(config)
  rope = {"rope_type": "default", "rope_theta": config.rope_theta, **(scaling or {})}
  hf_config = dict(
    architectures=[_HF_CLASSES[config.architecture]],
    model_type=config.architecture,
    vocab_size=config.vocab_size,
    hidden_size=config.hidden_size,
    intermediate_size=config.intermediate_size,
    num_hidden_layers=config.num_layers,
    num_attention_heads=config.num_heads,
    num_key_value_heads=config.num_kv_heads,
    head_dim=config.head_dim,
    hidden_act="silu",
    max_position_embeddings=config.max_position_embeddings,
    rms_norm_eps=config.rms_norm_eps,
    rope_theta=config.rope_theta,
    rope_scaling=scaling,
    rope_parameters=rope,
    tie_word_embeddings=config.tie_embeddings,
    eos_token_id=config.eos_token_id,
    pad_token_id=config.pad_token_id,
    mask_token_id=config.mask_token_id,
    dtype=config.param_dtype,
  )
  if config.architecture != "qwen2":
    hf_config["attention_bias"] = False
  return hf_config


def find_mask_token_id(path: str | pathlib.Path) -> int | None:
  """The mask token id the tokenizer files in `path` define, if any (see `discover_special_tokens`)."""
  return discover_special_tokens(str(path)).mask


def load_hf_config(path: str | pathlib.Path, **overrides) -> ModelConfig:
  """`config_from_hf` of `path`/config.json, with the mask token taken from
  config.json's `mask_token_id` or else from the tokenizer files in `path`."""
  path = pathlib.Path(path)
  config_file = path / "config.json"
  if not config_file.exists():
    raise FileNotFoundError(f"{config_file} not found; point at a Hugging Face checkpoint directory.")
  hf_config = json.loads(config_file.read_text())
  if hf_config.get("mask_token_id") is None:
    hf_config["mask_token_id"] = find_mask_token_id(path)
  return config_from_hf(hf_config, **overrides)


# --------------------------------------------------------------------------
# Loading.


def _checkpoint_files(path: pathlib.Path) -> list[pathlib.Path]:
  index = path / _INDEX_FILE
  if index.exists():
    names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    absent = [name for name in names if not (path / name).exists()]
    if absent:
      raise FileNotFoundError(f"{index} lists shards that are missing from {path}: {absent}.")
    return [path / name for name in names]
  if (path / _SINGLE_FILE).exists():
    return [path / _SINGLE_FILE]
  raise FileNotFoundError(f"No {_SINGLE_FILE} or {_INDEX_FILE} in {path}.")


class _SafetensorsFile:
  """A safe_open'ed file whose read errors say which file is broken."""

  def __init__(self, file: pathlib.Path):
    self.file = file

  def __enter__(self):
    try:
      self._handle = safe_open(self.file, framework="numpy")
      return self._handle.__enter__()
    except SafetensorError as error:
      raise self._broken(error) from error

  def __exit__(self, kind, error, trace):
    self._handle.__exit__(kind, error, trace)
    if isinstance(error, SafetensorError):
      raise self._broken(error) from error

  def _broken(self, error: Exception) -> ValueError:
    return ValueError(
      f"Could not read {self.file} ({error}); it looks truncated or corrupt. Download or save it again."
    )


def _read_tensor(file: pathlib.Path, name: str) -> np.ndarray:
  with _SafetensorsFile(file) as handle:
    return handle.get_tensor(name)


_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16}


def _stored_tensors(files: list[pathlib.Path]) -> dict[str, tuple[tuple[int, ...], Any, pathlib.Path]]:
  """{name: (shape, dtype, file)} of every tensor in the files, read from their headers."""
  tensors: dict[str, tuple[tuple[int, ...], Any, pathlib.Path]] = {}
  for file in files:
    with _SafetensorsFile(file) as handle:
      for name in handle.keys():
        if name in tensors:
          raise ValueError(f"{file.name}: tensor {name} appears twice (also in {tensors[name][2].name}).")
        piece = handle.get_slice(name)
        dtype = piece.get_dtype()
        if dtype not in _DTYPES:
          raise ValueError(f"{file.name}: tensor {name} has dtype {dtype}; expected one of {sorted(_DTYPES)}.")
        tensors[name] = (tuple(piece.get_shape()), np.dtype(_DTYPES[dtype]), file)
  return tensors


def _fetcher(tensors: dict[str, tuple[tuple[int, ...], Any, pathlib.Path]]) -> Fetch:
  """Reads each requested tensor once and places it slice by slice onto its target sharding."""

  def place(array: np.ndarray, target: jax.ShapeDtypeStruct) -> jax.Array:
    return jax.make_array_from_callback(
      target.shape, target.sharding, lambda index: array[index].astype(target.dtype, copy=False)
    )

  def fetch(requests: Sequence[tuple[str, jax.ShapeDtypeStruct]]) -> list[jax.Array]:
    return [place(_read_tensor(tensors[name][2], name), target) for name, target in requests]

  return fetch


def _check_tied_head(tensors: dict, config: ModelConfig) -> dict:
  """The tensors without a tied `lm_head.weight` (accepted only when it equals the embedding)."""
  if not config.tie_embeddings or "lm_head.weight" not in tensors:
    return tensors
  tensors = dict(tensors)
  head_file = tensors.pop("lm_head.weight")[2]
  head = _read_tensor(head_file, "lm_head.weight")
  if not np.array_equal(head, _read_tensor(tensors["model.embed_tokens.weight"][2], "model.embed_tokens.weight")):
    raise ValueError(
      f"{head_file.name}: lm_head.weight differs from model.embed_tokens.weight although config.json says "
      "tie_word_embeddings=true; load with config_overrides={'tie_embeddings': False}."
    )
  return tensors


def hf_source(path: str | pathlib.Path, config: ModelConfig) -> Source:
  """The safetensors of the Hugging Face directory `path`, to be read into a model of `config`."""
  path = pathlib.Path(path)
  files = _checkpoint_files(path)
  tensors = _check_tied_head(_stored_tensors(files), config)
  return Source(
    format="hf",
    location=f"Hugging Face checkpoint {path} (config.json, {len(files)} safetensors file(s))",
    arrays={name: (shape, dtype) for name, (shape, dtype, _) in tensors.items()},
    table=TABLE,
    fetch=_fetcher(tensors),
    where=lambda name: f"{tensors[name][2].name}: " if name in tensors else "",
  )


# --------------------------------------------------------------------------
# Saving.


def _shard(sizes: list[int], max_bytes: int | None) -> list[list[int]]:
  """Consecutive groups of tensor indices of at most `max_bytes` each (a
  tensor larger than that gets a group of its own)."""
  groups: list[list[int]] = [[]]
  total = 0
  for i, size in enumerate(sizes):
    if groups[-1] and max_bytes is not None and total + size > max_bytes:
      groups.append([])
      total = 0
    groups[-1].append(i)
    total += size
  return groups


def save_hf(
  model: Transformer, path: str | pathlib.Path, max_shard_bytes: int | None = None, dequantize: bool = False
) -> None:
  """Write `model` as a Hugging Face checkpoint that transformers'
  `AutoModelForCausalLM.from_pretrained(path)` loads.

  Writes config.json and model.safetensors, or, when the tensors exceed
  `max_shard_bytes`, model-0000i-of-0000n.safetensors shards with
  model.safetensors.index.json. Replaces any checkpoint files already in
  `path`. Tensors are copied to the host one shard at a time.

  A quantized model (refusion_jax.model.quant) is refused: a Hugging Face
  checkpoint holds float kernels. `dequantize=True` writes q · scale in the
  config's `param_dtype` instead (not the original weights: the rounding stays).
  """
  if any(True for _ in lora.adapted_kernels(model)):
    raise ValueError(
      "The model carries LoRA adapters, which a Hugging Face checkpoint has no place for: save "
      "merge_lora(model) (the adapters folded into the kernels), or the adapters alone with save_lora."
    )
  if model.config.quantize != "none":
    if not dequantize:
      raise ValueError(
        f"The model's projections are {model.config.quantize}, and a Hugging Face checkpoint holds float "
        "kernels: pass dequantize=True (--dequantize) to write them dequantized, or save the float model."
      )
    model = quantize_lib.dequantize(model)
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=2) + "\n")

  entries = []  # (Hugging Face name, rule, parameter variable)
  for p, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    name, rule = TABLE.stored(dotted(p))
    entries.append((name, rule, variable))
  sizes = [math.prod(v.shape) * v.dtype.itemsize for _, _, v in entries]
  groups = _shard(sizes, max_shard_bytes)

  for stale in [path / _SINGLE_FILE, path / _INDEX_FILE, *path.glob("model-*-of-*.safetensors")]:
    stale.unlink(missing_ok=True)
  count = len(groups)
  file_names = [_SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
  weight_map = {}
  for file_name, group in zip(file_names, groups):
    tensors = {}
    for i in group:
      name, rule, variable = entries[i]
      tensors[name] = np.ascontiguousarray(_TO_HF[rule.to_ours](np.asarray(variable.get_value())))
      weight_map[name] = file_name
    save_file(tensors, path / file_name, metadata={"format": "pt"})
  if count > 1:
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
    (path / _INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
