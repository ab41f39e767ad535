"""Which checkpoint format a path holds, found from its files and its orbax metadata.

| format     | what is looked for                                                          |
| ---------- | --------------------------------------------------------------------------- |
| `hf`       | `config.json` beside `model.safetensors` or `model.safetensors.index.json`  |
| `refusion` | a training workdir: `[checkpoints/]<step>/params` with `<step>/meta`        |
| `tunix`    | `<root>/<step>/model_params` (tunix's checkpoint manager)                   |
| `maxtext`  | `<root>/<step>/items` whose tree holds `params.params.decoder`              |

Orbax formats may be given as the root (the latest step is taken unless
`step` says otherwise), a step folder or the item folder itself; an item
folder's format is read from its tree (`embedder.*` is tunix,
`params.params.*` MaxText, `embed_tokens.*` ours).
"""

from __future__ import annotations

import dataclasses
import os

from refusion_jax.checkpoints import maxtext, orbax, orbax_tree, tunix

FORMATS = ("hf", "refusion", "tunix", "maxtext")
_ITEMS = {orbax.PARAMS: "refusion", tunix.ITEM: "tunix", maxtext.ITEM: "maxtext"}

LOOKED_FOR = (
  "config.json + model.safetensors[.index.json] (hf); "
  f"[checkpoints/]<step>/{orbax.PARAMS} + <step>/{orbax.META} (refusion); "
  f"<step>/{tunix.ITEM} (tunix); <step>/{maxtext.ITEM} (maxtext); "
  f"or an orbax item folder holding {orbax_tree.METADATA_FILE}"
)


@dataclasses.dataclass(frozen=True)
class Found:
  """A located checkpoint.

  Attributes:
    format: one of `FORMATS`.
    path: the Hugging Face directory, the run's checkpoint directory (refusion) or the item folder.
    step: the step of an orbax format (None for hf).
    description: what was found, in words.
  """

  format: str
  path: str
  step: int | None
  description: str


def _is_hf(path: str) -> bool:
  names = ("model.safetensors", "model.safetensors.index.json")
  return os.path.isfile(os.path.join(path, "config.json")) and any(
    os.path.isfile(os.path.join(path, name)) for name in names
  )


def _steps(root: str) -> list[int]:
  """Fully written steps: orbax writes into a temporary name and renames it when done."""
  return sorted(int(name) for name in os.listdir(root) if name.isdigit() and os.path.isdir(os.path.join(root, name)))


def _step_dir_format(step_dir: str) -> str | None:
  return next((fmt for item, fmt in _ITEMS.items() if os.path.isdir(os.path.join(step_dir, item))), None)


def _item_format(item_dir: str) -> str | None:
  names = orbax_tree.item_arrays(item_dir)
  roots = {name.split(".")[0] for name in names}
  if any(name.startswith("params.params.") for name in names):
    return "maxtext"
  if "embedder" in roots or any("_lora_" in name for name in names):
    return "tunix"
  if "embed_tokens" in roots:
    return "refusion"
  return None


def _found(fmt: str, step_dir: str, step: int, how: str) -> Found:
  item = os.path.join(step_dir, next(item for item, f in _ITEMS.items() if f == fmt))
  if fmt == "refusion":
    return Found(fmt, os.path.dirname(step_dir), step, f"refusion training checkpoint, step {step} ({how})")
  return Found(fmt, item, step, f"{fmt} checkpoint, step {step}, item {item} ({how})")


def _from_root(root: str, step: int | None) -> Found | None:
  steps = _steps(root)
  if not steps:
    return None
  chosen = steps[-1] if step is None else step
  if chosen not in steps:
    raise ValueError(f"No step {chosen} in {root}; its steps are {steps}.")
  fmt = _step_dir_format(os.path.join(root, str(chosen)))
  how = f"{'latest of ' if step is None else ''}steps {steps} in {root}"
  return None if fmt is None else _found(fmt, os.path.join(root, str(chosen)), chosen, how)


def detect(path: str, step: int | None = None) -> Found:
  """Locate the checkpoint at `path` and tell its format.

  Raises:
    FileNotFoundError: nothing there, or nothing recognised (listing what was looked for).
    ValueError: `step` is not one of the saved steps, or was given for a Hugging Face directory.
  """
  path = orbax.local_path(path)
  if not os.path.exists(path):
    raise FileNotFoundError(
      f"No checkpoint directory at {path!r}: it does not exist. Pass a training workdir, a Hugging Face directory "
      "or a tunix / MaxText checkpoint."
    )
  if _is_hf(path):
    if step is not None:
      raise ValueError(f"step={step} was given, but {path} is a Hugging Face checkpoint, which has no steps.")
    return Found("hf", path, None, f"Hugging Face checkpoint {path} (config.json + safetensors)")
  if os.path.isfile(os.path.join(path, orbax_tree.METADATA_FILE)):
    fmt = _item_format(path)
    parent = os.path.basename(os.path.dirname(path))
    if fmt is not None and parent.isdigit():
      return _found(fmt, os.path.dirname(path), int(parent), "an item folder")
    if fmt in ("tunix", "maxtext"):
      return Found(fmt, path, None, f"{fmt} checkpoint item {path}")
  fmt = _step_dir_format(path)
  if fmt is not None and os.path.basename(path).isdigit():
    if step is not None and step != int(os.path.basename(path)):
      raise ValueError(f"step={step} was given, but {path} is the folder of step {os.path.basename(path)}.")
    return _found(fmt, path, int(os.path.basename(path)), "a step folder")
  for root in (os.path.join(path, orbax.CHECKPOINT_SUBDIR), path):
    if os.path.isdir(root):
      found = _from_root(root, step)
      if found is not None:
        return found
  raise FileNotFoundError(f"{path} holds no checkpoint this package reads; looked for {LOOKED_FOR}.")
