"""Baseline: plain next-token (AR) training of the demo model on the demo data, decoded autoregressively.

    python -m refusion_jax.train --config configs/ar_baseline.py --workdir /tmp/refusion_ar

Identical to configs/demo.py except the objective; evaluation decodes with
`refusion_jax.AR` (one token per forward). `:smoke` works as
for the demo.
"""

import pathlib

import ml_collections

from refusion_jax.training.config_file import load_config


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  config = load_config(pathlib.Path(__file__).with_name("demo.py"), variant)
  config.objective.kind = "ar"  # next-token cross entropy on the answer; no masking
  return config
