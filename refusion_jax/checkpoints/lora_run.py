"""The checkpoints of a LoRA training run: the frozen base written once, the adapters at every step.

    workdir/
      lora_base/0/{params,meta}     the frozen base, written once when the run starts (a model checkpoint
                                    of ours: `load_model(workdir + "/lora_base")` loads it alone)
      checkpoints/<step>/params     the adapters only (`*_lora.lora_a`, `*_lora.lora_b`)
      checkpoints/<step>/train      their optimizer state, step and RNG (as any run)
      checkpoints/<step>/meta       the base's ModelConfig, `lora` (the LoraConfig) and `lora_base`
                                    (the base's directory, relative to the checkpoint directory)

The base is written once rather than found again from `config.init_from` at
resume: the base a run trains on is not always the one `init_from` names (a
Hugging Face base gains a mask token and an embedding row for it), a random
base exists nowhere else, and `init_from` may move or change. It costs one
write of the base (16.4 GB for Qwen3-8B in bfloat16) instead of one at every
save.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from refusion_jax.checkpoints import orbax_tree
from refusion_jax.checkpoints.orbax import PARAMS, Checkpoints, model_meta, run_step
from refusion_jax.model import lora
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer
from refusion_jax.parallel import sharding

# The base's directory, beside the run's checkpoint directory.
BASE_SUBDIR = "lora_base"


def base_directory(checkpoint_directory: str) -> str:
  """Where a run whose checkpoints are in `checkpoint_directory` keeps its frozen base."""
  return os.path.join(os.path.dirname(os.path.abspath(checkpoint_directory)), BASE_SUBDIR)


def meta_fields(lora_config: lora.LoraConfig, checkpoint_directory: str) -> dict[str, Any]:
  """What a LoRA run's `meta` item adds to `model_meta` (nothing when LoRA is off)."""
  if not lora_config.enabled:
    return {}
  relative = os.path.relpath(base_directory(checkpoint_directory), os.path.abspath(checkpoint_directory))
  return dict(lora=dataclasses.asdict(lora_config), lora_base=relative)


def stored_lora(meta: dict) -> lora.LoraConfig:
  """The `LoraConfig` a run's meta records (rank 0 for a run without adapters)."""
  return lora.LoraConfig(**meta["lora"]) if meta.get("lora") else lora.LoraConfig()


def save_base(frozen: nnx.State, model_config: ModelConfig, tokenizer: str, checkpoint_directory: str) -> str:
  """Write the frozen base once (step 0 of `base_directory`), waiting until it is on disk; returns the directory.

  `tokenizer` as the run's meta names it (relative to the checkpoint directory, or a name): the base's meta
  gets a name that resolves from its own directory.
  """
  directory = base_directory(checkpoint_directory)
  local = os.path.join(checkpoint_directory, tokenizer)
  if os.path.isdir(local):
    tokenizer = os.path.relpath(local, directory)
  with Checkpoints(directory, max_to_keep=1, async_save=False) as base:
    base.save_model(0, params=frozen, meta=model_meta(model_config, tokenizer))
    base.wait()
  return directory


def has_base(checkpoint_directory: str) -> bool:
  """Whether the run's base was written (a complete step 0 in `base_directory`)."""
  directory = base_directory(checkpoint_directory)
  if not os.path.isdir(directory):
    return False
  with Checkpoints(directory, async_save=False) as base:
    return 0 in base.all_steps()


def restore_base(abstract_frozen: nnx.State, checkpoint_directory: str) -> nnx.State:
  """The frozen base of a run, restored into `abstract_frozen` (ShapeDtypeStructs carrying the shardings).

  Raises:
    FileNotFoundError: the run has no base (its `lora_base` directory was deleted or moved).
  """
  directory = base_directory(checkpoint_directory)
  if not has_base(checkpoint_directory):
    raise FileNotFoundError(
      f"This LoRA run's checkpoints hold only the adapters; its frozen base should be in {directory}, which holds "
      "no complete checkpoint. Restore that directory (it is written once, when the run starts)."
    )
  with Checkpoints(directory, async_save=False) as base:
    return base.restore(0, abstract_params=abstract_frozen).params


def with_adapters(params: nnx.State, model_config: ModelConfig, lora_config: lora.LoraConfig, seed: int) -> nnx.State:
  """A base model's parameters plus fresh adapters (B = 0) on the kernels `lora_config` targets."""
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0))))
  return nnx.state(lora.add_lora(nnx.merge(graphdef, params), lora_config, seed))


def is_lora_run(path: str, step: int | None = None) -> bool:
  """Whether the training checkpoint at `path` (workdir or checkpoint directory) holds a LoRA run's adapters."""
  return bool(run_step(path, step)[2].get("lora"))


def add_run_adapters(model: Transformer, path: str, step: int | None, mesh: Mesh | None, rules) -> Transformer:
  """`model` (the run's base, loaded by the caller) with the adapters of the run's `step` (default: the
  latest), unmerged; changed in place and returned. The loader loads the base (`base_of`): this module,
  the layout of a run, never imports it."""
  directory, step, meta = run_step(path, step)
  lora.add_lora(model, stored_lora(meta))
  item = os.path.join(directory, str(step), PARAMS)
  fill_adapters(model, orbax_tree.fetcher(item), orbax_tree.item_arrays(item), item, mesh, rules)
  return model


def base_of(path: str, step: int | None = None) -> str:
  """The base directory of a LoRA run's checkpoint (workdir or checkpoint directory) at `step`.

  Raises:
    FileNotFoundError: the base directory the run recorded is gone.
  """
  directory, step, meta = run_step(path, step)
  base_dir = os.path.normpath(os.path.join(directory, meta["lora_base"]))
  if not os.path.isdir(base_dir):
    raise FileNotFoundError(
      f"{directory} step {step} holds LoRA adapters only; their frozen base should be in {base_dir}, which does "
      "not exist (it is written once, when the run starts). Restore it there."
    )
  return base_dir


def fill_adapters(model: Transformer, fetch, stored: dict, where: str, mesh: Mesh | None, rules) -> None:
  """Set every adapter of `model` from the arrays of an item of ours (names: state paths + ".value").

  Raises:
    ValueError: an adapter the model has is missing, or stored with another shape (both named).
  """
  adapters, _ = lora.split_adapters(nnx.state(model))
  flat = nnx.to_flat_state(adapters)
  requests = []
  for path, variable in flat:
    name = ".".join(str(k) for k in path) + ".value"
    if name not in stored:
      raise ValueError(f"{where} has no array {name!r}: it holds {len(stored)} arrays, e.g. {sorted(stored)[:3]}.")
    if tuple(stored[name][0]) != tuple(variable.shape):
      raise ValueError(
        f"{where}: {name!r} has shape {list(stored[name][0])}, the model expects {list(variable.shape)}."
      )
    spec = sharding.logical_to_spec(
      variable.get_metadata().get("out_sharding") or (), rules or sharding.LOGICAL_AXIS_RULES
    )
    if mesh is None:
      placement = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    else:
      placement = jax.sharding.NamedSharding(mesh, spec)
    requests.append((name, jax.ShapeDtypeStruct(variable.shape, variable.get_value().dtype, sharding=placement)))
  values = fetch(requests)
  for (_, variable), value in zip(flat, values):
    variable.set_value(value)
  nnx.update(model, nnx.from_flat_state(flat))
