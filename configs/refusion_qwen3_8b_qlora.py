"""QLoRA: the official LoRA recipe over an int8 (or int4) frozen Qwen3-8B base, on one 16 GB chip.

    python -m refusion_jax.train --config configs/refusion_qwen3_8b_qlora.py --workdir DIR \\
        --config.init_from=/mnt/models/Qwen3-8B --config.data.train_files=/mnt/data/refusion_train.json
    # int4 base (a quarter of bf16's bytes, more rows, 1-2.5 points lower on the demo): --config.quantize=int4

Everything as `configs/refusion_qwen3_8b_lora.py` (rank-8 adapters on q/k/v/o,
float32 adapters and Adam state), except that the base's projections are
quantized while the checkpoint is read (refusion_jax.model.quant: int8 per
output channel, or int4 in groups of 128 inputs) and stay frozen integers;
the embedding and LM head stay bfloat16. The base takes 9.4 GB in int8 and 6.1
GB in int4 instead of 16.4 GB in bfloat16, so the run fits one v5e chip
(16 GiB) instead of a v5p one. Checkpoints hold the adapters; the integer base
is written once to `workdir/lora_base`. `python -m refusion_jax.convert WORKDIR
OUT --to peft` exports the adapters; `--to hf --dequantize` the merged model in
bfloat16 (the base's rounding stays in it).

Fit (ahead-of-time compile for one chip of a v5e:2x2 topology; results/quantization.md has the table
and the commands): `python -m refusion_jax.aot --config configs/refusion_qwen3_8b_qlora.py --topology
v5e:2x2 --config.mesh.fsdp=1 --config.mesh.data=1 --programs train`: the int8 base, 8 rows of 4096 in 4
microbatches, takes 14.9 GB of the chip's 17.2 (9.53 arguments, 5.36 temporaries; microbatches of 3 rows take
17.1, at the limit); the int4 base with microbatches of 3 rows takes 14.8 GB.
"""

import pathlib

import ml_collections

from refusion_jax.training.config_file import load_config


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  """`variant`: "" for the recipe, "smoke" for its whole path in seconds on any small checkpoint."""
  config = load_config(pathlib.Path(__file__).with_name("refusion_qwen3_8b_lora.py"), variant)
  config.quantize = "int8"  # the frozen base's projections: "int8" (0.3 points from bf16 on the demo) or "int4"
  config.quantize_group_size = 128  # int4: inputs per scale
  if variant != "smoke":
    config.batch_size = 8  # the LoRA recipe's sequences per step,
    config.grad_accum_steps = 4  # in microbatches of 2 rows that fit one v5e chip (results/quantization.md)
    config.data.seq_len = 4096  # the recipe's longest rows
  return config
