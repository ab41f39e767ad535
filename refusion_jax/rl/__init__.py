"""Reinforcement learning after SFT (docs/rl.md): the exact replay of a rollout's log-probabilities."""

from refusion_jax.rl.replay import trajectory_logprobs as trajectory_logprobs
