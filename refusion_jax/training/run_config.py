"""What a training config means: the model config, the objective, and the checks made before anything runs.

- `model_config_from`: `config.model` (a preset plus overrides) with the special
  ids resolved against the tokenizer.
- `check_hf_architecture`: a Hugging Face `init_from` checkpoint must be the
  architecture `config.model.preset` names.
- `check_run_config`: what can be refused before anything runs (renamed fields,
  fields a run cannot start without), named together.
- `objective_config_from`: `config.objective` with the model's mask and pad ids.
- `lora_config_from`: `config.lora`, the adapters a LoRA run trains.
- `quantized_as_configured`: `config.quantize`, the integer base a QLoRA run trains adapters over.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from refusion_jax.checkpoints.detect import FORMATS
from refusion_jax.checkpoints.mapping import ARRAY_FIELDS
from refusion_jax.data.special_tokens import SpecialTokens, resolve_special_tokens, with_special_tokens
from refusion_jax.data.tokenizer import Tokenizer
from refusion_jax.model import quant
from refusion_jax.model.config import ModelConfig, preset
from refusion_jax.model.lora import LoraConfig
from refusion_jax.training.objective import ObjectiveConfig

# The `config.model` fields that say how a model runs (memory against recomputation, the attention kernel, scanned
# layers), not what it is: the run's own choice, whatever checkpoint it starts or resumes from.
_EXECUTION_FIELDS = ("remat", "attention_impl", "attention_chunk", "scan_layers")
# The `config.model` fields that configure how a model runs, not what it is.
_RUNTIME_FIELDS = ("preset", "dtype", "param_dtype", *_EXECUTION_FIELDS)
# The fields a Hugging Face `init_from` checkpoint must share with `config.model.preset`: what its arrays determine,
# except the vocabulary (it follows the tokenizer, and grows for an added mask token), and what they do not show.
_ARCHITECTURE_FIELDS = ("architecture", *(f for f in ARRAY_FIELDS if f != "vocab_size"), "rope_theta")
_SPECIAL_ID_FIELDS = {"mask": "mask_token_id", "eos": "eos_token_id", "pad": "pad_token_id"}


def preset_with_overrides(model_fields: ml_collections.ConfigDict) -> ModelConfig:
  """`model_fields.preset` with every other field that is set (not None) as an override.

  A config may declare a field as `config_dict.placeholder(int)` (None until a flag sets it), so that
  `--config.model.num_layers=8` works on a config that otherwise takes the preset's value.
  """
  fields = {name: value for name, value in dict(model_fields).items() if value is not None}
  return preset(fields.pop("preset"), **fields)


def model_config_from(config: ml_collections.ConfigDict, tokenizer: Tokenizer) -> ModelConfig:
  """`config.model.preset` with every other `config.model` field that is set as an override.

  Special token ids follow `resolve_special_tokens`: ids set in `config.model`,
  then the tokenizer's, then the preset's; the model config records them, so
  that a checkpoint's model config is enough to decode.
  """
  model_config = preset_with_overrides(config.model)
  explicit = SpecialTokens(**{name: config.model.get(field) for name, field in _SPECIAL_ID_FIELDS.items()})
  return with_special_tokens(model_config, resolve_special_tokens(explicit, tokenizer=tokenizer, config=model_config))


def run_as_configured(model_config: ModelConfig, model_fields: ml_collections.ConfigDict) -> ModelConfig:
  """`model_config` with the execution fields (`_EXECUTION_FIELDS`: remat, attention, scan) `config.model` sets."""
  return model_config.replace(**{name: model_fields[name] for name in _EXECUTION_FIELDS if name in model_fields})


def check_hf_architecture(model_fields: ml_collections.ConfigDict, hf_config: ModelConfig, path: str) -> None:
  """A Hugging Face `init_from` must have the architecture `config.model` describes (unless its preset is "").

  Raises:
    ValueError: naming the first field where the checkpoint's config.json and
      `config.model` differ.
  """
  name = model_fields.get("preset", "")
  if not name:
    return
  overrides = {k: v for k, v in dict(model_fields).items() if k not in _RUNTIME_FIELDS and v is not None}
  expected = preset(name, **overrides)
  for field in _ARCHITECTURE_FIELDS:
    want, got = getattr(expected, field), getattr(hf_config, field)
    if want != got:
      raise ValueError(
        f"config.init_from={path!r} is not the architecture config.model describes (preset {name!r}): "
        f"its config.json gives {field}={got!r}, config.model {field}={want!r}. Point config.init_from at a "
        f"{name} checkpoint, or set --config.model.preset='' to fine-tune any architecture."
      )


# Fields of earlier versions -> what replaced them; a config that still sets one is refused naming the new field.
RENAMED_FIELDS = {
  "init_from_hf": "config.init_from (with config.init_format='auto' or 'hf')",
  "init_from_checkpoint": "config.init_from (with config.init_format='auto' or 'refusion')",
}


def check_run_config(config: ml_collections.ConfigDict, resuming: bool) -> None:
  """Everything about a training config that can be refused before anything is built, all named at once.

  Raises:
    ValueError: a field replaced by another, a bad `checkpoint.on_corrupt`, or
      required fields left empty (each named, with how to set it).
  """
  renamed = [f"config.{old} was replaced by {new}" for old, new in RENAMED_FIELDS.items() if old in config]
  if renamed:
    raise ValueError("; ".join(renamed) + ". Rename the field in your config or command line.")
  if config.checkpoint.on_corrupt not in ("fallback", "fail"):
    raise ValueError(f"checkpoint.on_corrupt={config.checkpoint.on_corrupt!r}; choose 'fallback' or 'fail'.")
  if config.init_format not in ("auto", *FORMATS):
    raise ValueError(f"config.init_format={config.init_format!r}; choose 'auto' or one of {FORMATS}.")
  lora_config_from(config)  # a bad config.lora is refused here, before any data or model is built
  check_quantize(config)
  missing = []
  if not (resuming or config.init_from or config.tokenizer):
    missing.append(
      "config.init_from (a checkpoint to start from: a Hugging Face directory to fine-tune, a run of ours, tunix or "
      "MaxText) or config.tokenizer ('bytes' or a tokenizer directory, to train from scratch)"
    )
  if config.data.dataset == "json" and not config.data.get("train_files"):
    missing.append("config.data.train_files (comma-separated query/response JSON files)")
  if missing:
    raise ValueError(
      "The config leaves required fields empty: " + "; ".join(missing) + ". Set them on the command line, "
      "e.g. --config.init_from=/path/to/Qwen3-8B --config.data.train_files=train.json."
    )


def lora_config_from(config: ml_collections.ConfigDict) -> LoraConfig:
  """The adapters `config.lora` asks for (rank 0, none, when the config has no `lora` section).

  Raises:
    ValueError: an unknown field of `config.lora`, or a value `LoraConfig` refuses (e.g. a target no module has).
  """
  fields = dict(config.get("lora") or {})
  unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(LoraConfig)})
  if unknown:
    known = [f.name for f in dataclasses.fields(LoraConfig)]
    raise ValueError(f"config.lora has unknown fields {unknown}; it takes {known}.")
  return LoraConfig(**fields)


def check_quantize(config: ml_collections.ConfigDict) -> None:
  """Refuse an unknown `config.quantize`, or a quantized base without adapters to train (QLoRA needs LoRA)."""
  mode = config.get("quantize", "none")
  quant.check_mode(mode)
  if mode != "none" and not lora_config_from(config).enabled:
    raise ValueError(
      f"config.quantize={mode!r} freezes integer kernels, which cannot train themselves: set "
      "--config.lora.rank (e.g. 8) to train float32 adapters over the quantized base (QLoRA), or "
      "--config.quantize=none to train every weight."
    )


def quantized_as_configured(model_config: ModelConfig, config: ml_collections.ConfigDict) -> ModelConfig:
  """`model_config` with the projections `config.quantize` asks for (`config.quantize_group_size` for int4).

  A float start (random, or a float checkpoint) takes them; a start that is quantized already (a resumed
  QLoRA run, a quantized checkpoint) must be quantized as asked.

  Raises:
    ValueError: the start is quantized otherwise than the config asks (both named).
  """
  mode, group_size = config.get("quantize", "none"), config.get("quantize_group_size", 128)
  if model_config.quantize == "none":
    return model_config if mode == "none" else model_config.replace(quantize=mode, quantize_group_size=group_size)
  if mode == model_config.quantize and (mode == "int8" or group_size == model_config.quantize_group_size):
    return model_config
  raise ValueError(
    f"The run starts from a base quantized as {model_config.quantize} (group size "
    f"{model_config.quantize_group_size}), but the config asks for quantize={mode!r} (group size {group_size}): "
    f"set --config.quantize={model_config.quantize} --config.quantize_group_size="
    f"{model_config.quantize_group_size}, or start from the float checkpoint (a new workdir)."
  )


def objective_config_from(config: ml_collections.ConfigDict, model_config: ModelConfig) -> ObjectiveConfig:
  """The objective of `config.objective`, with the model's mask and pad ids."""
  mask_id = model_config.mask_token_id
  if mask_id is None:
    if config.objective.kind != "ar":
      raise ValueError("The model has no mask token id; set config.model.mask_token_id or use a tokenizer with one.")
    mask_id = 0  # never fed: the AR objective masks nothing
  return ObjectiveConfig(
    kind=config.objective.kind,
    slot_sizes=tuple(config.objective.slot_sizes),
    eps=config.objective.eps,
    loss_chunk=config.objective.loss_chunk,
    mask_id=mask_id,
    pad_id=model_config.pad_token_id,
    eos_id=model_config.eos_token_id,
  )
