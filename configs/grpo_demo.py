"""GRPO after the demo: reinforcement learning of the README main job's model on the built-in tasks, on a CPU.

    python -m refusion_jax.train --config configs/demo.py --workdir /tmp/refusion_demo        # the SFT model first
    python -m refusion_jax.train --config configs/grpo_demo.py --workdir /tmp/refusion_grpo

Starts from the demo's checkpoint (`config.init_from`), samples `grpo.num_generations` answers per training prompt
with ReFusion's speculative acceptance (the policy whose answer probabilities are exact, docs/rl.md §1), scores them
with the task solvers' rewards and updates by GRPO (docs/rl.md). Validation decodes as the demo does (its
`config.eval`), so its exact match compares with the SFT model's. Everything else (checkpoints, resume, SIGTERM,
LoRA, the mesh) is the training loop's. `--config.objective.kind=ar` with an AR baseline checkpoint trains the AR
policy the same way.

The defaults are the recipe results/rl_demo.md measured best: 32 prompts a step, learning rate 1e-4, the
exact-match reward (partial credit paid lookup's near misses and lowered its exact match), 40 steps, about 10
minutes on an idle 2-core CPU. From the README main job's model they leave validation exact match near the start's
43%; from a model given 1,500 more supervised steps (55%) they add 3-4 points and raise tokens per forward from 2.5
to about 3. Continued SFT is the cheaper way to learn on these tasks in both cases (results/rl_demo.md).

`--config configs/grpo_demo.py:smoke` trains a tiny random model for a few steps: the plumbing, in seconds.
"""

import pathlib

import ml_collections
from ml_collections import config_dict

from refusion_jax.training.config_file import load_config


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  """`variant`: "" for the demo, "smoke" for a tiny plumbing check."""
  if variant not in ("", "smoke"):
    raise ValueError(f"Unknown config variant {variant!r}; use '' or 'smoke'.")
  config = load_config(pathlib.Path(__file__).with_name("demo.py"), variant)
  config.init_from = "" if variant else "/tmp/refusion_demo"  # the README main job's workdir (its last step)

  # A `grpo` section makes `python -m refusion_jax.train` train by GRPO (refusion_jax.rl); names are tunix's.
  config.grpo = ml_collections.ConfigDict()
  config.grpo.num_generations = 8  # answers sampled per prompt: the group each advantage is relative to
  config.grpo.num_iterations = 1  # optimizer updates per batch of rollouts (mu)
  config.grpo.beta = 0.04  # KL penalty to the starting model (0: the reference is never evaluated)
  config.grpo.epsilon = 0.2  # the ratio's lower clip, 1 - epsilon
  config.grpo.epsilon_high = config_dict.placeholder(float)  # the upper clip, 1 + epsilon_high (unset: epsilon)
  # "sequence-mean-token-mean" (GRPO), "token-mean" (DAPO / TRL's bnpo), "sequence-mean-token-scale" (Dr. GRPO),
  # "seq-mean-token-sum", "sequence-mean-token-sum-norm"
  config.grpo.loss_agg_mode = "sequence-mean-token-mean"
  config.grpo.kl_loss_mode = "low_var_kl"  # k3 (Schulman's), "kl" (k1) or "mse_kl" (k2)
  config.grpo.advantage_estimator = "grpo"  # (r - mean) / std per group; "drgrpo": r - mean; "rloo"
  config.grpo.max_response_length = 0  # "sequence-mean-token-scale"'s divisor (0: eval.gen_length)
  config.grpo.temperature = 1.0  # the rollouts' sampling temperature (> 0)
  # Reward functions by import path, (prompts, completions, **columns) -> list[float]; their rewards are summed.
  config.grpo.rewards = ("refusion_jax.rl.rewards.exact_match",)
  config.grpo.max_prompt_length = 48  # prompt tokens (the built-in tasks' queries fit; longer records refused)
  config.grpo.rollout_rows = 0  # rows the rollout's decode loop keeps busy (0: every answer of a step at once)
  config.grpo.use_rollout_logps = True  # old policy = the rollout's log-probabilities (AR may recompute: False)

  # Prompts per step (each answered num_generations times). 8 gave a gradient too noisy to move the model at any
  # rate tried (2e-4 once collapsed it to 32%); 32 at 1e-4 gained 3-4 points from a later SFT model
  # (results/rl_demo.md).
  config.batch_size = 32
  config.num_train_steps = 40
  config.optimizer.lr = 1e-4
  config.optimizer.warmup_steps = 10
  config.optimizer.decay = "constant"
  config.log_every = 5
  config.eval_every = 20
  config.checkpoint.every = 20
  if variant == "smoke":
    # The plumbing of more than one reward, summed.
    config.grpo.rewards = ("refusion_jax.rl.rewards.exact_match", "refusion_jax.rl.rewards.partial_credit")
    config.grpo.num_generations = 2
    config.batch_size = 2
    config.num_train_steps = 3
    config.log_every = 1
    config.eval_every = 0
    config.checkpoint.every = 1
  return config
