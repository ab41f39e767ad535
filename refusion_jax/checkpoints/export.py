"""Writing a model as a checkpoint to start from: converting any supported checkpoint to Hugging Face or to
our run directory, with its tokenizer copied along (`python -m refusion_jax.convert`).

A run directory written here (`OUT/checkpoints/<step>/{params,meta}`) holds no optimizer or data state: it
is sampled from, or training starts from it with `--config.init_from=OUT`.
"""

from __future__ import annotations

import os
import shutil

from flax import nnx

from refusion_jax.checkpoints import orbax
from refusion_jax.checkpoints.detect import Found
from refusion_jax.checkpoints.hf import save_hf
from refusion_jax.checkpoints.load import inspect_checkpoint, load_model, locate
from refusion_jax.checkpoints.peft import save_lora
from refusion_jax.data.tokenizer import load_tokenizer
from refusion_jax.model.lora import merge_lora

# What a tokenizer directory holds beside tokenizer.json.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def copy_tokenizer(directory: str | None, out: str) -> None:
  """Copy the tokenizer files of `directory` (if it is a tokenizer directory, not "bytes") into `out`."""
  if directory in (None, "bytes"):
    return
  os.makedirs(out, exist_ok=True)
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(directory, name)):
      shutil.copy(os.path.join(directory, name), os.path.join(out, name))


def tokenizer_source(found: Found, config: str | None, tokenizer: str | None = None) -> str | None:
  """The tokenizer that goes with the converted model: "bytes", a directory holding tokenizer.json, or None.

  `tokenizer` when given (checked), else the source's own, else `config`'s when it is a directory.
  """
  if tokenizer:
    load_tokenizer(tokenizer)  # refuses, naming it, a directory without tokenizer.json
    return tokenizer
  if found.format == "refusion":
    candidate = orbax.refusion_source(found.path, found.step)[1]
  else:
    candidate = found.path if found.format == "hf" else config
  if candidate == "bytes" or (candidate and os.path.isfile(os.path.join(candidate, "tokenizer.json"))):
    return candidate
  return None


def write_refusion(model: nnx.Module, out: str, step: int, tokenizer: str | None) -> None:
  """A run directory holding only the parameters and the meta item (the model config and tokenizer)."""
  directory = os.path.join(orbax.local_path(out), orbax.CHECKPOINT_SUBDIR)
  if tokenizer not in (None, "bytes"):
    copy_tokenizer(tokenizer, os.path.join(directory, orbax.TOKENIZER_SUBDIR))
    tokenizer = orbax.TOKENIZER_SUBDIR
  with orbax.Checkpoints(directory, async_save=False) as checkpoints:
    checkpoints.save_model(step, params=nnx.state(model), meta=orbax.model_meta(model.config, tokenizer))
    checkpoints.wait()


def convert(
  source: str,
  out: str | None = None,
  *,
  to: str | None = None,
  inspect: bool = False,
  format: str = "auto",
  config: str | None = None,
  step: int | None = None,
  dtype: str | None = None,
  tokenizer: str | None = None,
  lora: str | None = None,
  dequantize: bool = False,
) -> str:
  """Write the checkpoint `source` to `out` in the format `to` ("hf" or "refusion"), with its tokenizer, or
  with `inspect` describe it; returns what was done, as one line.

  A model with LoRA adapters (a LoRA run, or `lora`: a peft adapter directory added to `source`) is written
  merged (`W + scale·A·B`), or with `to="peft"` as its adapters alone, in peft's format.

  A quantized model (int8 / int4 projections) is written as it is to "refusion"; "hf", or merging adapters
  into it, needs `dequantize` (float kernels q · scale in the stored `param_dtype`, or `dtype`).

  The tokenizer copied along is `tokenizer` if given, else the source's (or `config`'s when it is a Hugging
  Face directory); none is found for tunix and MaxText sources without one.

  Raises:
    ValueError: the arguments do not name one action (SRC OUT with `to`, or SRC with `inspect`).
  """
  if inspect:
    if out or to:
      raise ValueError("--inspect takes only SRC (and --format / --step).")
    return str(inspect_checkpoint(source, format=format, step=step))
  if not out or not to:
    raise ValueError("Give SRC OUT --to hf|refusion|peft, or SRC --inspect.")
  found = locate(source, format, step)
  model = load_model(source, format=found.format, config=config, step=step, dtype=dtype, lora=lora)
  if to == "peft":
    save_lora(model, out, base_model_name_or_path=source)
    return f"wrote the LoRA adapters of the {found.description} to {out} (peft format)"
  model = merge_lora(model, dequantize=dequantize)
  tokenizer = tokenizer_source(found, config, tokenizer)
  if to == "hf":
    save_hf(model, out, dequantize=dequantize)
    copy_tokenizer(tokenizer, out)
  else:
    write_refusion(model, out, found.step or 0, tokenizer)
  note = "" if tokenizer else " (no tokenizer found to copy: pass --tokenizer)"
  return f"wrote {to} checkpoint {out} from the {found.description}{note}"
