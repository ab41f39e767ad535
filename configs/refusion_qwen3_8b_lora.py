"""The official LoRA recipe: adapt Qwen3-8B (or the released ReFusion) with rank-8 adapters on one chip.

    python -m refusion_jax.train --config configs/refusion_qwen3_8b_lora.py --workdir DIR \\
        --config.init_from=/mnt/models/Qwen3-8B --config.data.train_files=/mnt/data/refusion_train.json

The official training script's `low_rank_training`: peft `LoraConfig(r=8,
lora_alpha=16, target_modules=["q_proj","k_proj","v_proj","o_proj"],
lora_dropout=0.01, bias="none")` with gradient checkpointing, everything else
as `configs/refusion_qwen3_8b.py` (learning rate 2e-5, cosine, no warmup, no
weight decay, 4 epochs, rows up to 4096 tokens). Only the adapters train:
7.67 M parameters (0.094 %), whose float32 weights, gradients and Adam state
take about 123 MB; the frozen base is stored in bfloat16 (16.4 GB), so the
whole run fits one accelerator instead of a pod slice. Checkpoints hold the
adapters and their optimizer state (the base is written once, to
`workdir/lora_base`); `python -m refusion_jax.convert WORKDIR OUT --to peft`
exports them as a peft adapter directory, `--to hf` as the merged model.

Fit (ahead-of-time compile for one v5p chip: `python -m refusion_jax.aot --config
configs/refusion_qwen3_8b_lora.py --topology v5p:2x2x1 --config.mesh.fsdp=1
--config.mesh.data=1 --programs train`; results/lora.md has the table): batch 8 x 4096
at grad_accum 1 takes 64 GB of the chip's 103 (16.5 arguments, 47.5 temporaries, of
which about 13.9 are the bfloat16 layer weights that scanning stacks).
"""

import pathlib

import ml_collections

from refusion_jax.training.config_file import load_config


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  """`variant`: "" for the recipe, "smoke" for its whole path in seconds on any small checkpoint."""
  config = load_config(pathlib.Path(__file__).with_name("refusion_qwen3_8b.py"), variant)
  config.lora.rank = 8  # the official adapter rank
  config.lora.alpha = 16.0  # scale alpha / r = 2
  config.lora.dropout = 0.01  # dropout on the adapters' inputs
  config.lora.targets = ("q_proj", "k_proj", "v_proj", "o_proj")  # attention only, as the official recipe
  config.lora.use_rslora = False
  config.optimizer.lr = 2e-5  # the official learning rate (the same for LoRA and full fine-tuning)
  if variant != "smoke":
    config.model.param_dtype = "bfloat16"  # the frozen base in bfloat16; adapters and Adam state stay float32
    config.batch_size = 8  # sequences per step on one chip (see the fit table): rows of up to 4096 tokens
  return config
