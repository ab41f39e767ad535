"""Helpers for tests that run the trainer: the repo root and the smoke configs."""

import os

import ml_collections

from refusion_jax.training import config_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(name: str, variant: str = "smoke") -> ml_collections.ConfigDict:
  """`configs/<name>.py`'s get_config(variant)."""
  return config_file.load_config(os.path.join(REPO, "configs", f"{name}.py"), variant)


def smoke_config(data_dir: str, name: str = "demo", **overrides) -> ml_collections.ConfigDict:
  config = load_config(name)
  config.data.data_dir = data_dir
  config.update(overrides)
  return config
