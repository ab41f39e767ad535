"""Baseline: token-level masked diffusion (LLaDA style) training of the demo model on the demo data.

    python -m refusion_jax.train --config configs/mdm_baseline.py --workdir /tmp/refusion_mdm

Identical to configs/demo.py except the objective (bidirectional attention,
tokens masked independently, CE / p); evaluation decodes with
`refusion_jax.MDM` (low-confidence remasking, `eval.mdm_steps`
forwards over blocks of `eval.mdm_block_length`). `:smoke` works as for the demo.
"""

import pathlib

import ml_collections

from refusion_jax.training.config_file import load_config


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  config = load_config(pathlib.Path(__file__).with_name("demo.py"), variant)
  config.objective.kind = "mdm"  # per-token masking with probability p, bidirectional attention
  config.data.packing = False  # an MDM answer runs to its row's end (EOS-padded): one example per row
  return config
