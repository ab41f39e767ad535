"""One front door for loading a model and its tokenizer from any supported source.

    model, tokenizer = load("/ckpt/Qwen3-0.6B")              # Hugging Face directory
    model, tokenizer = load("/runs/demo", step=500)          # a training workdir
    model, tokenizer = load("tiny", format="preset")         # random init, byte tokenizer

| format     | what `source` is                                         | tokenizer                       |
| ---------- | -------------------------------------------------------- | ------------------------------- |
| `hf`       | directory with config.json + safetensors                 | its tokenizer.json, if any      |
| `refusion` | a training workdir or its `checkpoints/` directory       | the one stored in the run's meta |
| `preset`   | a preset name of `refusion_jax.model.config.PRESETS`     | "bytes" unless given            |
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
from flax import nnx

from refusion_jax.checkpoints import hf
from refusion_jax.checkpoints import orbax as refusion_checkpoints
from refusion_jax.data.tokenizer import Tokenizer, load_tokenizer
from refusion_jax.model import config as config_lib
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer, abstract_model, init_model

FORMATS = ("hf", "refusion", "preset")


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


def detect_format(source: str) -> str:
  """The format of `source`: "hf" (config.json), "refusion" (orbax step folders) or "preset" (a preset name)."""
  if os.path.isfile(os.path.join(source, "config.json")):
    return "hf"
  if os.path.isdir(source):
    return "refusion"
  if not os.path.exists(source) and source in config_lib.PRESETS:
    return "preset"
  raise FileNotFoundError(
    f"Cannot tell what {source!r} is: looked for a Hugging Face directory (config.json), a training workdir "
    f"(checkpoints/ or step folders) and a preset name ({sorted(config_lib.PRESETS)})."
  )


def cast_model(model: Transformer, dtype: str) -> Transformer:
  """The same weights with activations and parameters in `dtype`."""
  model_config = model.config.replace(dtype=dtype, param_dtype=dtype)
  graphdef, _ = abstract_model(model_config)
  state = jax.tree.map(lambda x: x.astype(model_config.weight_dtype), nnx.state(model))
  return nnx.merge(graphdef, state)


def load(
  source: str,
  *,
  format: str = "auto",
  step: int | None = None,
  tokenizer: str | None = None,
  dtype: str | None = None,
  seed: int = 0,
) -> tuple[Transformer, Tokenizer]:
  """Load the model and its tokenizer from `source` (see the module docstring for the formats).

  Args:
    source: a checkpoint directory or, with format "preset", a preset name.
    format: "auto" (detect from the files) or one of `FORMATS`.
    step: with a training workdir, the step to load (default: the latest).
    tokenizer: "bytes" or a directory with tokenizer.json, replacing the source's own.
    dtype: activation and parameter dtype (default: as stored; float32 for presets).
    seed: with a preset, the seed of the random weights.

  Returns:
    The model, and its tokenizer (a `NoTokenizer` when the checkpoint has none and none was given).
  """
  format = detect_format(source) if format == "auto" else format
  if format not in FORMATS:
    raise ValueError(f"Unknown format {format!r}; choose 'auto' or one of {FORMATS}.")
  if step is not None and format != "refusion":
    raise ValueError(f"step={step} only applies to training workdirs; {source!r} is a {format!r} source.")
  dtypes = {} if dtype is None else dict(dtype=dtype, param_dtype=dtype)

  if format == "preset":
    chosen = load_tokenizer(tokenizer or "bytes")
    model_config = config_lib.preset(source).replace(
      vocab_size=chosen.vocab_size,
      mask_token_id=chosen.mask_id,
      eos_token_id=chosen.eos_id,
      pad_token_id=chosen.pad_id,
      **dtypes,
    )
    return init_model(model_config, seed), chosen

  if format == "hf":
    if not os.path.isdir(source):
      raise FileNotFoundError(f"{source!r} is not a directory; a Hugging Face checkpoint is a directory.")
    model = hf.load_hf(source, **dtypes)
    if tokenizer:
      return model, load_tokenizer(tokenizer)
    if os.path.isfile(os.path.join(source, "tokenizer.json")):
      return model, load_tokenizer(source)
    return model, NoTokenizer(source, model.config)

  model, stored_tokenizer = refusion_checkpoints.load_model_from_checkpoint(source, step)
  if dtype is not None:
    model = cast_model(model, dtype)
  return model, load_tokenizer(tokenizer or stored_tokenizer)
