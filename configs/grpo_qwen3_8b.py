"""GRPO on Qwen3-8B ReFusion with LoRA: speculative ReFusion rollouts, 8 answers a prompt, on a v5p slice.

    launch/tpu_pod.sh --accelerator=v5p-16 my-tpu us-east5-a configs/grpo_qwen3_8b.py /mnt/b/grpo \\
        --config.init_from=/mnt/b/refusion_qwen3_8b --config.data.train_files=/mnt/b/prompts.json
    # one 16 GB v5e chip, the base's projections in int8: configs/grpo_qwen3_8b.py:v5e

Starts from a ReFusion Qwen3-8B (`init_from`: e.g. the released ReFusion, or the merged output of
configs/refusion_qwen3_8b.py) and trains rank-8 LoRA adapters on q/k/v/o (configs/refusion_qwen3_8b_lora.py:
the base frozen in bfloat16, adapters and Adam state float32) by GRPO (docs/rl.md): each step decodes
`batch_size` prompts `num_generations` times with ReFusion's speculative acceptance at temperature 1 (the policy
whose answer probabilities are exact, docs/rl.md §1), scores them with `grpo.rewards` and updates on the
group-relative advantages, with a KL penalty to the base (the reference is the base with its adapters off: no
second copy of the weights). Prompts are JSON records with a "query" and the columns the rewards read (the
built-in rewards: "response"; docs/rl.md §6), up to `grpo.max_prompt_length` tokens with the chat template.
Every process of a pod decodes the step's global batch on the whole mesh (docs/rl.md §5, "Several processes").

Fit (ahead-of-time compile of the step's programs, `python -m refusion_jax.aot --config configs/grpo_qwen3_8b.py
--topology v5p:2x2x2 --programs grpo`; results/rl_scale.md has the table and the commands): the rollout, the
reference log-probs and the update of 64 answers (8 prompts x 8) of 256 + 256 tokens, FSDP over the chips, fit
one v5p host (4 chips, 40 GB of a chip's 103 at most) and a v5p-16 slice (8 chips); `:v5e` fits one 16 GB v5e
chip with an int8 base.

Variants: "" the v5p recipe; "v5e" one v5e chip (int8 base, 1 prompt x 8 answers a step, the update in
microbatches of 2 answers, logits 128 answer tokens at a time); "smoke" the recipe's path (LoRA, speculative
rollouts, the reference with adapters off) on configs/grpo_demo.py:smoke's tiny random model, in seconds.
"""

import pathlib

import ml_collections

from refusion_jax.training.config_file import load_config

_HERE = pathlib.Path(__file__).parent


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  """`variant`: "" for the v5p recipe, "v5e" for one 16 GB v5e chip with an int8 base, "smoke" for seconds."""
  if variant not in ("", "v5e", "smoke"):
    raise ValueError(f"Unknown config variant {variant!r}; use '', 'v5e' or 'smoke'.")
  if variant == "smoke":
    config = load_config(_HERE / "grpo_demo.py", "smoke")  # a tiny random model, the built-in tasks
    config.lora.rank, config.lora.targets = 4, ("q_proj", "k_proj", "v_proj", "o_proj")
    return config
  config = load_config(_HERE / "refusion_qwen3_8b_lora.py")  # the LoRA recipe: every field documented there
  config.grpo = load_config(_HERE / "grpo_demo.py").grpo  # every GRPO field documented there
  config.grpo.num_generations = 8  # answers per prompt: the group each advantage is relative to
  config.grpo.num_iterations = 1  # one update per batch of rollouts (the old policy is the rollout's own)
  config.grpo.beta = 0.04  # KL to the base: the adapters off, no second copy of the weights
  config.grpo.temperature = 1.0  # the rollouts' sampling temperature
  config.grpo.rewards = ("refusion_jax.rl.rewards.exact_match",)  # reads each record's "response"
  config.grpo.max_prompt_length = 256  # prompt tokens with the chat template (longer records are refused)
  config.grpo.rollout_rows = 0  # every answer of a step decoded at once (64 rows)

  config.eval.gen_length = 256  # the rollouts' (and validation's) answer budget G
  config.eval.slot_size = 8  # slot size S, as the recipe decodes
  config.eval.serial_blocks = 4  # serial blocks NB: 64 answer tokens each

  config.data.dataset = "json"  # prompt records (docs/rl.md §6)
  config.data.seq_len = config.grpo.max_prompt_length + config.eval.gen_length  # validation's loss rows
  config.batch_size = 8  # prompts per step: 64 answers, 8 rows a chip on v5p-16 (16 on one v5p host)
  config.update(grad_accum_steps=1, num_train_steps=500, num_epochs=1, log_every=1, eval_every=100)
  config.optimizer.update(lr=1e-5, warmup_steps=10, decay="constant")  # half the LoRA recipe's 2e-5, then constant
  config.checkpoint.every = 50
  if variant == "v5e":
    config.quantize = "int8"  # the frozen base's projections (configs/refusion_qwen3_8b_qlora.py)
    config.batch_size = 1  # one prompt x 8 answers a step on one chip (results/rl_scale.md)
    config.grad_accum_steps = 4  # the update's gradient in microbatches of 2 answers
    config.objective.loss_chunk = 128  # answer tokens whose [rows, chunk, vocab] logits are live at once
    config.mesh.data, config.mesh.fsdp = 1, 1  # one chip
  return config
