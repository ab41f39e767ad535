"""Baseline: plain next-token (AR) training of the demo model on the demo data, decoded autoregressively.

    python -m refusion_jax.train --config configs/ar_baseline.py --workdir /tmp/refusion_ar

Identical to configs/demo.py except the objective; evaluation decodes with
`refusion_jax.baselines.ar_generate` (one token per forward). `:smoke` works as
for the demo.
"""

import importlib.util
import os

import ml_collections


def _demo_config(variant: str) -> ml_collections.ConfigDict:
  # Config files are loaded by path, not as a package: load the demo the same way.
  spec = importlib.util.spec_from_file_location("demo_config", os.path.join(os.path.dirname(__file__), "demo.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant)


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  config = _demo_config(variant)
  config.objective.kind = "ar"  # next-token cross entropy on the answer; no masking
  return config
