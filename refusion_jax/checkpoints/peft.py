"""LoRA adapters in peft's file format, both ways: what the official ReFusion training writes, and what
`peft.PeftModel.from_pretrained(Qwen3ForCausalLM, dir)` reads.

    save_lora(model, "/adapters/run1")                 # adapter_config.json + adapter_model.safetensors
    model = load_lora(base_model, "/adapters/run1")    # the base, with those adapters (unmerged)
    model = load_model("/ckpt/ReFusion", lora="/adapters/run1")

A peft directory holds `adapter_config.json` (`peft_type: "LORA"`, `r`, `lora_alpha`,
`target_modules`, `use_rslora`, ...) and `adapter_model.safetensors` with, per adapted module,
`base_model.model.model.layers.{i}.{self_attn|mlp}.{name}.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r] (torch's `Linear` layout, out before in). Our adapters keep the
kernel's axes (A [embed, r] for q_proj, B [r, heads, head_dim]); heads are flattened head-major,
as `refusion_jax.checkpoints.hf` flattens the base's kernels. The scale is `lora_alpha / r`
(`/ sqrt(r)` with `use_rslora`), so a merged kernel is `W + scale · B @ A` in peft's terms.
"""

from __future__ import annotations

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from refusion_jax.model import lora
from refusion_jax.model.transformer import Transformer

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model.model.layers"
_KEY = re.compile(rf"^{re.escape(_PREFIX)}\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# adapter_config.json fields this loader cannot honour when set: what each would need.
_UNSUPPORTED = {
  "rank_pattern": "a rank per module",
  "alpha_pattern": "an alpha per module",
  "layers_to_transform": "adapters on some layers only",
  "modules_to_save": "fully trained extra modules",
  "use_dora": "DoRA's magnitude vectors",
}


def _peft_name(layer: int, kernel: str, factor: str) -> str:
  parent = lora.TARGETS[kernel][0]
  return f"{_PREFIX}.{layer}.{parent}.{kernel}.lora_{factor}.weight"


def _to_peft(adapter: lora.LoraAdapter) -> tuple[np.ndarray, np.ndarray]:
  """Our A [*in, r], B [r, *out] -> peft's A [r, in], B [out, r] (multi-axis widths flattened head-major)."""
  a, b = np.asarray(adapter.lora_a[...], np.float32), np.asarray(adapter.lora_b[...], np.float32)
  rank = a.shape[-1]
  return a.reshape(-1, rank).T, b.reshape(rank, -1).T


def save_lora(model: Transformer, directory: str, base_model_name_or_path: str = "") -> None:
  """Write `model`'s adapters as peft does (float32), for `peft.PeftModel.from_pretrained`.

  Args:
    directory: created if needed; holds adapter_config.json and adapter_model.safetensors.
    base_model_name_or_path: recorded in adapter_config.json (peft's pointer to the base).

  Raises:
    ValueError: the model carries no adapters.
  """
  config = lora.lora_config_of(model)
  if not config.enabled:
    raise ValueError("The model carries no LoRA adapters to save (add them with add_lora, or train with lora.rank>0).")
  tensors = {}
  for layer, kernel, _, adapter in lora.adapted_kernels(model):
    tensors[_peft_name(layer, kernel, "A")], tensors[_peft_name(layer, kernel, "B")] = _to_peft(adapter)
  peft_config = dict(
    peft_type="LORA",
    task_type="CAUSAL_LM",
    r=config.rank,
    lora_alpha=config.alpha,
    lora_dropout=config.dropout,
    target_modules=list(config.targets),
    bias="none",
    use_rslora=config.use_rslora,
    fan_in_fan_out=False,
    inference_mode=True,
    init_lora_weights=True,
    base_model_name_or_path=base_model_name_or_path or None,
  )
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, CONFIG_FILE), "w") as f:
    json.dump(peft_config, f, indent=2)
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(directory, WEIGHTS_FILE))


def read_lora_config(directory: str) -> lora.LoraConfig:
  """The `LoraConfig` of a peft adapter directory.

  Raises:
    FileNotFoundError: no adapter_config.json there.
    ValueError: not a LoRA adapter, or a setting this loader cannot honour (named).
  """
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{directory} holds no {CONFIG_FILE}: not a peft adapter directory.")
  with open(path) as f:
    stored = json.load(f)
  if stored.get("peft_type") != "LORA":
    raise ValueError(f"{path} describes a {stored.get('peft_type')!r} adapter; only peft_type 'LORA' loads here.")
  unsupported = [f"{name} ({what})" for name, what in _UNSUPPORTED.items() if stored.get(name)]
  if stored.get("bias", "none") != "none":
    unsupported.append(f"bias={stored['bias']!r} (trained biases)")
  if stored.get("fan_in_fan_out"):
    unsupported.append("fan_in_fan_out (Conv1D layouts)")
  targets = stored.get("target_modules")
  if not isinstance(targets, list):
    unsupported.append(f"target_modules={targets!r} (give the module names as a list)")
  if unsupported:
    raise ValueError(f"{path} uses settings this loader does not support: {', '.join(unsupported)}.")
  return lora.LoraConfig(
    rank=int(stored["r"]),
    alpha=float(stored["lora_alpha"]),
    dropout=float(stored.get("lora_dropout", 0.0)),
    targets=tuple(t for t in lora.TARGETS if t in targets) + tuple(t for t in targets if t not in lora.TARGETS),
    use_rslora=bool(stored.get("use_rslora", False)),
  )


def load_lora(model: Transformer, directory: str) -> Transformer:
  """`model` (a base without adapters) with the peft adapters of `directory`, unmerged; changed in place.

  Raises:
    ValueError: a tensor is missing, unexpected, or has a shape that does not fit this base (each
      named with what was expected), e.g. an adapter trained on another architecture.
  """
  config = read_lora_config(directory)
  tensors = load_file(os.path.join(directory, WEIGHTS_FILE))
  lora.add_lora(model, config)
  where = os.path.join(directory, WEIGHTS_FILE)
  unexpected = sorted(name for name in tensors if not _KEY.match(name))
  if unexpected:
    raise ValueError(
      f"{where} holds tensors that are no LoRA factor of a decoder layer: {unexpected[:3]} "
      f"(expected names like {_peft_name(0, config.targets[0], 'A')!r})."
    )
  expected = set()
  for layer, kernel, _, adapter in lora.adapted_kernels(model):
    for factor, variable in (("A", adapter.lora_a), ("B", adapter.lora_b)):
      name = _peft_name(layer, kernel, factor)
      expected.add(name)
      if name not in tensors:
        raise ValueError(f"{where} has no tensor {name!r}, which target_modules={list(config.targets)} implies.")
      value = tensors[name]
      rank = config.rank
      want = (rank, math.prod(variable.shape[:-1])) if factor == "A" else (math.prod(variable.shape[1:]), rank)
      if tuple(value.shape) != want:
        raise ValueError(
          f"{where}: {name!r} has shape {list(value.shape)}, this base expects {list(want)} "
          f"(r={rank}; the adapter was trained on another architecture or size, or r disagrees)."
        )
      ours = value.T.reshape(variable.shape)
      variable.set_value(jax.device_put(jnp.asarray(ours, jnp.float32), variable.get_value().sharding))
  extra = sorted(set(tensors) - expected)
  if extra:
    raise ValueError(
      f"{where} holds adapters this base has no place for, e.g. {extra[0]!r} (the base has "
      f"{model.config.num_layers} layers; target_modules={list(config.targets)})."
    )
  return model
