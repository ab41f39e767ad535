"""A run's training config: loaded from a config file by path, and recorded in (and read back from) its workdir.

A run writes its resolved config to `WORKDIR/train_config.json` when it starts,
so that later commands (`eval`) need only `--checkpoint WORKDIR`, from any
folder, to apply the config it was trained with.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
from typing import Any

import ml_collections

# The resolved config of the run, in its workdir (beside `checkpoints/`). Not `config.json`: a Hugging Face
# directory holds a model config under that name.
RUN_CONFIG_FILE = "train_config.json"


def load_config(path: str | pathlib.Path, variant: str = "") -> ml_collections.ConfigDict:
  """Call `get_config(variant)` of the config file at `path`.

  Config files live outside the package (`configs/`) and are loaded by path,
  so one config that extends another (the baselines extend the demo) loads it
  this way too.
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"No config file at {path}.")
  spec = importlib.util.spec_from_file_location(f"config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant) if variant else module.get_config()


def write_run_config(config: ml_collections.ConfigDict, workdir: str) -> str:
  """Record `config` (every field resolved, command-line overrides included) in `workdir`; returns the file.

  Written whole under a temporary name and renamed, so a reader never sees half a file; a resumed run
  rewrites it with the config it resumes with.
  """
  path = os.path.join(workdir, RUN_CONFIG_FILE)
  partial = f"{path}.tmp-{os.getpid()}"
  with open(partial, "w", encoding="utf-8") as f:
    f.write(config.to_json(indent=1) + "\n")
  os.replace(partial, path)
  return path


def recorded_config_path(workdir: str) -> str | None:
  """The run config recorded in `workdir`, or None (a run trained before runs recorded theirs, or not a run)."""
  path = os.path.join(workdir, RUN_CONFIG_FILE)
  return path if os.path.isfile(path) else None


def read_run_config(path: str) -> ml_collections.ConfigDict:
  """A config recorded by `write_run_config`, with its sequences as tuples again (as config files write them)."""
  with open(path, encoding="utf-8") as f:
    return ml_collections.ConfigDict(_tuples(json.load(f)))


def _tuples(value: Any) -> Any:
  """JSON's lists back to tuples, recursively (dicts stay dicts)."""
  if isinstance(value, dict):
    return {key: _tuples(item) for key, item in value.items()}
  if isinstance(value, list):
    return tuple(_tuples(item) for item in value)
  return value
