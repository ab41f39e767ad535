"""Load an ml_collections config file by path, as `--config path:variant` does."""

from __future__ import annotations

import importlib.util
import pathlib

import ml_collections


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
