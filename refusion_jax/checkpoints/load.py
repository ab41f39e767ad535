"""One front door for loading a model (and its tokenizer) from any supported checkpoint, straight onto a mesh.

    model, tokenizer = load("/ckpt/Qwen3-0.6B")                     # Hugging Face directory
    model = load_model("/runs/demo", step=500)                      # our training workdir
    model = load_model("/tunix/ckpts", config="/ckpt/Qwen3-0.6B")   # tunix root, step or item folder
    model = load_model("/maxtext/run/checkpoints", config="qwen3_0p6b", mesh=mesh)
    model, tokenizer = load("tiny", format="preset")                # random init, byte tokenizer
    model = load_model("/ckpt/ReFusion", lora="/adapters/run1")     # a base plus peft LoRA adapters
    print(inspect_checkpoint("/tunix/ckpts"))                       # format, arrays, inferred fields

`load` and `load_model` take the same arguments; every loader of the package
(the sampler, evaluation, conversion, the trainer's `init_from`) goes through them.

`format="auto"` finds the format from the files and the orbax metadata
(`refusion_jax.checkpoints.detect`) and logs what it found. Whatever the stored
arrays determine (vocabulary, widths, layers, heads, KV heads, head dim, q/k
norms, biases, tied head) is read from them; a `config` that disagrees is
refused naming the field. tunix and MaxText store no config, so `config` is
then required: a `ModelConfig`, a preset name, or a directory holding the
Hugging Face config.json of the model the run started from (its tokenizer,
if there, is the one `load` returns).

A LoRA training run of ours loads as its base with the adapters of the step
(`refusion_jax.checkpoints.lora_run`); `lora=DIR` adds a peft adapter directory
to any base (`refusion_jax.checkpoints.peft`). Either way the adapters stay
unmerged: `refusion_jax.model.lora.merge_lora` folds them into the kernels.

Every parameter is restored straight into its sharding on `mesh` by the
logical-axis `rules` (default: the first device), one array at a time where
its layout must change, so the model is never held twice on the host.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh

from refusion_jax.checkpoints import hf, lora_run, mapping, maxtext, orbax, orbax_tree, peft, tunix
from refusion_jax.checkpoints.detect import FORMATS, Found, detect
from refusion_jax.checkpoints.restore import Source, build_model, check_config
from refusion_jax.data.tokenizer import Tokenizer, load_tokenizer
from refusion_jax.model import config as config_lib
from refusion_jax.model import lora as lora_lib
from refusion_jax.model import quant
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer, init_model
from refusion_jax.parallel.sharding import Rules

logger = logging.getLogger(__name__)

ConfigLike = ModelConfig | str | None


class NoTokenizer:
  """Stands in for the tokenizer of a checkpoint that ships none: token ids work, text does not.

  Encoding text is refused with a message naming the checkpoint and the two ways
  out; answers decode to their ids ("5,6,7") since no vocabulary is known. The
  special ids come from the model config.
  """

  def __init__(self, source: str, model_config: ModelConfig):
    self.source = source
    self.vocab_size = model_config.vocab_size
    self.pad_id = model_config.pad_token_id
    self.eos_id = model_config.eos_token_id
    self.mask_id = model_config.mask_token_id
    self.bos_id = None

  def encode(self, text: str) -> list[int]:
    raise ValueError(
      f"{self.source} has no tokenizer (no tokenizer.json), so text prompts cannot be encoded. Pass a tokenizer "
      "(--tokenizer DIR holding tokenizer.json, or 'bytes' for a byte-level model), or give the prompt as token "
      "ids (--prompt_ids 1,2,3)."
    )

  def decode(self, ids: Sequence[int]) -> str:
    return ",".join(str(int(i)) for i in ids)

  def apply_chat_template(self, query: str) -> str:
    return query


def resolve_config(config: ConfigLike) -> ModelConfig | None:
  """A `ModelConfig` from a `ModelConfig`, a preset name or a directory holding an HF config.json."""
  if config is None or isinstance(config, ModelConfig):
    return config
  if os.path.isfile(os.path.join(config, "config.json")):
    return hf.load_hf_config(config)
  if config in config_lib.PRESETS:
    return config_lib.preset(config)
  raise ValueError(
    f"config={config!r} is neither a preset ({sorted(config_lib.PRESETS)}) nor a directory holding config.json."
  )


def locate(path: str, format: str = "auto", step: int | None = None) -> Found:
  """The checkpoint at `path`, checked to be of `format` unless that is "auto"."""
  if format != "auto" and format not in FORMATS:
    raise ValueError(f"Unknown format {format!r}; choose 'auto' or one of {FORMATS}.")
  found = detect(path, step)
  if format not in ("auto", found.format):
    raise ValueError(f"format={format!r} was asked for, but {path} holds a {found.description}.")
  return found


def _open(found: Found, config: ModelConfig | None) -> Source:
  if found.format == "hf":
    return hf.hf_source(found.path, config)
  if found.format == "refusion":
    return orbax.refusion_source(found.path, found.step)[0]
  if found.format == "tunix":
    return tunix.tunix_source(found.path, found.description)
  architecture = config.architecture if config is not None else "qwen3"
  return maxtext.maxtext_source(found.path, found.description, architecture)


@dataclasses.dataclass(frozen=True)
class Quantize:
  """What a load asks for its projections: `mode` None (as stored), "none", "int8" or "int4"."""

  mode: str | None = None
  group_size: int = 128

  def applied_to(self, config: ModelConfig) -> ModelConfig:
    """`config` (the stored model's) with the quantization asked for; checked before anything is read.

    Raises:
      ValueError: an unknown mode or group size, or a checkpoint already quantized otherwise (a quantized
        checkpoint loads as it is: it is never quantized twice).
    """
    if self.mode is None:
      return config
    quant.check_mode(self.mode)
    if config.quantize != "none":
      if self.mode == config.quantize and (self.mode == "int8" or self.group_size == config.quantize_group_size):
        return config
      raise ValueError(
        f"The checkpoint is already quantized ({config.quantize}, group size {config.quantize_group_size}); it "
        f"loads as stored and is never quantized twice, so quantize={self.mode!r} does not apply. Load it without "
        "quantize (refusion_jax.dequantize(model) gives float kernels), or quantize its float original."
      )
    if self.mode == "none":
      return config
    quant.check_backend(self.mode)
    return config.replace(quantize=self.mode, quantize_group_size=self.group_size)


def _with_dtypes(config: ModelConfig, dtype: str | None, param_dtype: str | None) -> ModelConfig:
  changes = {} if dtype is None else dict(dtype=dtype, param_dtype=dtype)
  if param_dtype is not None:
    changes["param_dtype"] = param_dtype
  return config.replace(**changes)


def load_model(
  path: str,
  *,
  format: str = "auto",
  config: ConfigLike = None,
  step: int | None = None,
  dtype: str | None = None,
  param_dtype: str | None = None,
  mesh: Mesh | None = None,
  rules: Rules | None = None,
  seed: int = 0,
  lora: str | None = None,
  quantize: str | None = None,
  quantize_group_size: int = 128,
) -> Transformer:
  """Load the model a checkpoint holds, each parameter restored straight onto its sharding.

  Args:
    path: a Hugging Face directory, a training workdir, or a tunix / MaxText
      checkpoint root, step folder or item folder; with format "preset" (or
      "auto" when no such path exists), a preset name: a random model.
    format: "auto" (detect), "hf", "refusion", "tunix", "maxtext" or "preset".
    config: the architecture (`ModelConfig`, preset name, or directory with an
      HF config.json). Required for tunix and MaxText, which store none;
      otherwise it replaces the stored one. Checked against the arrays.
    step: the step of an orbax checkpoint (default: the latest).
    dtype: activation dtype (and parameter dtype unless `param_dtype` is given);
      default: the config's.
    param_dtype: parameter dtype; stored arrays are cast to it as they are read.
    mesh, rules: the mesh and logical-axis rules to place parameters by
      (default: everything on the first device).
    seed: with a preset, the seed of the random weights.
    lora: a peft adapter directory (adapter_config.json + adapter_model.safetensors) to add, unmerged,
      to the model `path` holds.
    quantize: "int8" or "int4" projection kernels (refusion_jax.model.quant), quantized while reading,
      one group of arrays at a time; None or "none": as stored (a quantized checkpoint loads quantized).
    quantize_group_size: int4's inputs per scale (0: one per output channel).

  Returns:
    The `Transformer` (`model(tokens)` gives logits).

  Raises:
    FileNotFoundError: nothing recognisable at `path` (the message lists what was looked for).
    ValueError: the format is not the one asked for; no config for a format that
      stores none; a config that disagrees with the arrays; a missing, unexpected
      or misfitting array (named); a LoRA-only tunix checkpoint; a MaxText scan axis
      that does not match; a LoRA adapter that does not fit the model (the tensor named); an unknown
      `quantize`, a group size that does not divide the projections' inputs, int4 where the backend
      cannot contract it, a checkpoint already quantized otherwise.
    NotImplementedError: an architecture feature we do not implement (e.g. a RoPE type).
  """
  quantized = Quantize(quantize, quantize_group_size)
  return _with_lora(_read_model(path, format, config, step, dtype, param_dtype, mesh, rules, seed, quantized)[0], lora)


def _read_model(
  source: str,
  format: str,
  config: ConfigLike,
  step: int | None,
  dtype: str | None,
  param_dtype: str | None,
  mesh: Mesh | None,
  rules: Rules | None,
  seed: int,
  quantized: Quantize,
  preset_tokenizer: str = "bytes",
) -> tuple[Transformer, Found | None, Tokenizer | None]:
  """(the model, the checkpoint it was read from, None), or for a preset name (a random model whose
  vocabulary and special ids are `preset_tokenizer`'s, None, that tokenizer)."""
  if format == "preset" or (format == "auto" and detect_format(source) == "preset"):
    tokenizer = load_tokenizer(preset_tokenizer)
    model = _random_model(source, tokenizer, config, step, dtype, param_dtype, seed, quantized)
    return model, None, tokenizer
  found = locate(source, format, step)
  return _model_of(found, resolve_config(config), dtype, param_dtype, mesh, rules, quantized), found, None


def _with_lora(model: Transformer, directory: str | None) -> Transformer:
  if directory is None:
    return model
  if any(True for _ in lora_lib.adapted_kernels(model)):
    raise ValueError(
      f"The checkpoint already carries LoRA adapters (a LoRA run's checkpoint); lora={directory!r} cannot be "
      "added on top. Merge them first (merge_lora) and add the new adapters to the merged model."
    )
  return peft.load_lora(model, directory)


def _model_of(
  found: Found,
  config: ModelConfig | None,
  dtype: str | None,
  param_dtype: str | None,
  mesh,
  rules,
  quantized: Quantize,
) -> Transformer:
  """The model of a located checkpoint; `config` replaces (and is checked against) what it stores."""
  logger.info("Loading %s", found.description)
  if found.format == "refusion" and lora_run.is_lora_run(found.path, found.step):
    if config is not None:
      raise ValueError(f"{found.path} is a LoRA run: its base records the config; pass no config.")
    base = load_model(
      lora_run.base_of(found.path, found.step),
      format="refusion",
      dtype=dtype,
      param_dtype=param_dtype,
      mesh=mesh,
      rules=rules,
      quantize=quantized.mode,
      quantize_group_size=quantized.group_size,
    )
    return lora_run.add_run_adapters(base, found.path, found.step, mesh, rules)
  base = config or (hf.load_hf_config(found.path) if found.format == "hf" else None)
  source = _open(found, base)
  base = base or source.config
  if base is None:
    raise ValueError(
      f"The {found.description} does not store the model's config (RoPE theta and scaling, norm epsilon, "
      "special ids): pass config= the one of the model it was trained from (a ModelConfig, a preset name, or "
      "a directory holding its Hugging Face config.json)."
    )
  if config is not None:
    check_config(source, config)
  return build_model(source, quantized.applied_to(_with_dtypes(base, dtype, param_dtype)), mesh, rules)


def checkpoint_tokenizer(found: Found, config: ConfigLike = None) -> str | None:
  """The tokenizer a checkpoint names (HF: its own tokenizer.json; ours: the one its run recorded; tunix /
  MaxText: the config directory's), as a name or path for `load_tokenizer`; None when it names none."""
  if found.format == "refusion":
    return orbax.refusion_source(found.path, found.step)[1]
  directory = found.path if found.format == "hf" else config if isinstance(config, str) else None
  if directory and os.path.isfile(os.path.join(directory, "tokenizer.json")):
    return directory
  return None


def detect_format(source: str) -> str:
  """The format of `source`: one of `FORMATS`, or "preset" for a preset name that is not a path."""
  if not os.path.exists(source) and source in config_lib.PRESETS:
    return "preset"
  return detect(source).format


def load(
  source: str,
  *,
  format: str = "auto",
  config: ConfigLike = None,
  step: int | None = None,
  tokenizer: str | None = None,
  dtype: str | None = None,
  param_dtype: str | None = None,
  mesh: Mesh | None = None,
  rules: Rules | None = None,
  seed: int = 0,
  lora: str | None = None,
  quantize: str | None = None,
  quantize_group_size: int = 128,
) -> tuple[Transformer, Tokenizer]:
  """`load_model` plus the tokenizer that goes with the model.

  Args:
    tokenizer: "bytes" or a directory with tokenizer.json, replacing the checkpoint's own.
    The other arguments are `load_model`'s.

  Returns:
    The model and its tokenizer (a `NoTokenizer` when the checkpoint names none
    and none was given; the byte tokenizer for presets unless given).
  """
  quantized = Quantize(quantize, quantize_group_size)
  model, found, preset_tokenizer = _read_model(
    source, format, config, step, dtype, param_dtype, mesh, rules, seed, quantized, tokenizer or "bytes"
  )
  model = _with_lora(model, lora)
  if found is None:
    return model, preset_tokenizer
  name = tokenizer or checkpoint_tokenizer(found, config)
  return model, (load_tokenizer(name) if name else NoTokenizer(source, model.config))


def _random_model(
  name: str,
  tokenizer: Tokenizer,
  config,
  step,
  dtype: str | None,
  param_dtype: str | None,
  seed: int,
  quantized: Quantize,
) -> Transformer:
  """A random model of preset `name` whose vocabulary and special ids are the tokenizer's."""
  if step is not None or config is not None:
    raise ValueError(f"step / config do not apply to the random preset {name!r}.")
  model_config = config_lib.preset(name).replace(
    vocab_size=tokenizer.vocab_size,
    mask_token_id=tokenizer.mask_id,
    eos_token_id=tokenizer.eos_id,
    pad_token_id=tokenizer.pad_id,
  )
  return init_model(quantized.applied_to(_with_dtypes(model_config, dtype, param_dtype)), seed)


@dataclasses.dataclass
class Inspection:
  """What `inspect_checkpoint` found: the format, every stored array and the fields they determine."""

  format: str
  description: str
  arrays: dict[str, tuple[tuple[int, ...], Any]]
  fields: dict[str, Any]
  unknown: list[str]
  stored_config: ModelConfig | None

  def __str__(self) -> str:
    lines = [f"format: {self.format}", f"found: {self.description}", f"arrays ({len(self.arrays)}):"]
    lines += [f"  {name}  {list(shape)}  {dtype}" for name, (shape, dtype) in sorted(self.arrays.items())]
    lines.append("fields the arrays determine:")
    lines += [f"  {field} = {value}" for field, value in self.fields.items()]
    if self.unknown:
      lines.append(f"arrays no rule maps to a parameter: {self.unknown}")
    if self.stored_config is not None:
      lines.append(f"stored config: {mapping.summary(self.stored_config)}")
    elif self.format in ("tunix", "maxtext"):
      lines.append("stored config: none (pass config= when loading)")
    return "\n".join(lines)


def inspect_checkpoint(path: str, *, format: str = "auto", step: int | None = None) -> Inspection:
  """The format of `path`, its stored arrays (names, shapes, dtypes) and the model fields they determine."""
  found = locate(path, format, step)
  if found.format in ("tunix", "maxtext"):  # read directly: a LoRA-only tunix checkpoint is still shown
    tunix_format = found.format == "tunix"
    arrays = orbax_tree.item_arrays(found.path) if tunix_format else maxtext.model_arrays(found.path)
    table, stored = (tunix.TABLE if tunix_format else maxtext.table()), None
  else:
    stored = hf.load_hf_config(found.path) if found.format == "hf" else None
    source = _open(found, stored)
    arrays, table, stored = source.arrays, source.table, stored or source.config
  entries, unknown = table.entries(arrays)
  return Inspection(found.format, found.description, arrays, mapping.infer_fields(entries), unknown, stored)
