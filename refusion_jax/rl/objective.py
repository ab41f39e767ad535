"""GRPO's objective in tunix's vocabulary: group-relative advantages, the clipped ratio, a KL penalty (docs/rl.md §4).

For each prompt the policy samples `num_generations` answers, a reward function scores them, and each answer's
advantage is its reward against its group's (`group_advantages`). The loss of a token t of answer i is PPO's
clipped surrogate with the rollout's log-probabilities as the old policy's, plus `beta` times a KL estimate to the
reference policy:

    ratio = exp(log pi(t) - log pi_old(t))
    pg(t) = max(-A_i * ratio, -A_i * clip(ratio, 1 - epsilon, 1 + epsilon_high))
    loss  = aggregate(pg + beta * kl(log pi, log pi_ref))       (aggregate: `loss_agg_mode`)

which is tunix's `grpo_loss_fn` (tunix/rl/algo_core.py) and TRL's `GRPOTrainer._compute_loss` (`loss_type`
"grpo" = "sequence-mean-token-mean", "bnpo" = "token-mean", "dr_grpo" = "sequence-mean-token-scale") on the same
inputs: tests/test_rl_objective.py holds the AR case to TRL's own loss and gradients. The method-specific part, the
per-token log-probabilities of a recorded answer under the current weights, is `refusion_jax.rl.replay`.

Everything here is a function of [batch, answer] arrays (batch = prompts x num_generations, group-major: the
answers of prompt j are rows j * G ... j * G + G - 1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

LOSS_AGG_MODES = (
  "token-mean",
  "sequence-mean-token-mean",
  "sequence-mean-token-scale",
  "seq-mean-token-sum",
  "sequence-mean-token-sum-norm",
)
KL_LOSS_MODES = ("low_var_kl", "kl", "mse_kl")
ADVANTAGE_ESTIMATORS = ("grpo", "drgrpo", "rloo")
# tunix's bound on the log-ratio before exp (algo_core.grpo_loss_fn): a stale token cannot overflow the ratio.
_LOG_RATIO_BOUND = 20.0
# Added to a group's reward spread before dividing by it (tunix's: a group of equal rewards gets advantages 0).
_STD_EPSILON = 1e-6


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOConfig:
  """GRPO's settings, named as tunix's `GRPOConfig` names them (docs/rl.md §4). Hashable: a static jit argument.

  Attributes:
    num_generations: G, the answers sampled per prompt (the group an advantage is relative to); >= 2.
    num_iterations: mu, the optimizer updates per batch of rollouts (the first is on-policy; later ones are clipped
      against the rollout's log-probabilities).
    beta: the KL penalty's coefficient (0: no reference policy is evaluated).
    epsilon: the ratio's lower clip, 1 - epsilon.
    epsilon_high: the ratio's upper clip, 1 + epsilon_high (DAPO's clip-higher); None: epsilon.
    loss_agg_mode: how token losses become one number: "sequence-mean-token-mean" (each answer's mean, averaged
      over answers: GRPO's paper, TRL's "grpo"), "token-mean" (over every token of the batch: TRL's "bnpo"),
      "sequence-mean-token-scale" (each answer's sum / `max_response_length`, averaged over answers: Dr. GRPO,
      TRL's "dr_grpo"), "seq-mean-token-sum" (each answer's sum, averaged), "sequence-mean-token-sum-norm"
      (the batch's sum / the number of answers).
    kl_loss_mode: the per-token KL estimator (tunix's names): "low_var_kl" (k3 = exp(r) - r - 1 with
      r = log pi_ref - log pi: Schulman's, TRL's), "kl" (k1 = log pi - log pi_ref) or "mse_kl" (k2).
    advantage_estimator: "grpo" ((r - group mean) / (group std + 1e-6), std with Bessel's correction: tunix's),
      "drgrpo" (r - group mean: Dr. GRPO, TRL's scale_rewards="none") or "rloo" (r - the mean of the group's
      other answers).
    max_response_length: the answer budget "sequence-mean-token-scale" divides by (0: the answers' width).
  """

  num_generations: int = 4
  num_iterations: int = 1
  beta: float = 0.04
  epsilon: float = 0.2
  epsilon_high: float | None = None
  loss_agg_mode: str = "sequence-mean-token-mean"
  kl_loss_mode: str = "low_var_kl"
  advantage_estimator: str = "grpo"
  max_response_length: int = 0

  def __post_init__(self) -> None:
    for name, low in (("num_generations", 2), ("num_iterations", 1)):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"GRPOConfig.{name}={value!r}; give an integer >= {low}.")
    for name in ("beta", "epsilon", "epsilon_high"):
      value = getattr(self, name)
      if value is not None and not (isinstance(value, (int, float)) and np.isfinite(value) and value >= 0):
        raise ValueError(f"GRPOConfig.{name}={value!r}; give a finite number >= 0.")
    for name, known in (
      ("loss_agg_mode", LOSS_AGG_MODES),
      ("kl_loss_mode", KL_LOSS_MODES),
      ("advantage_estimator", ADVANTAGE_ESTIMATORS),
    ):
      if getattr(self, name) not in known:
        raise ValueError(f"GRPOConfig.{name}={getattr(self, name)!r}; choose one of {known}.")
    if self.max_response_length < 0:
      raise ValueError(f"GRPOConfig.max_response_length={self.max_response_length}; give 0 (the width) or more.")

  @property
  def upper_epsilon(self) -> float:
    """The upper clip's epsilon (`epsilon_high`, else `epsilon`)."""
    return self.epsilon if self.epsilon_high is None else self.epsilon_high


def group_advantages(rewards: np.ndarray, num_generations: int, estimator: str = "grpo") -> np.ndarray:
  """Each answer's advantage against its prompt's group (`GRPOConfig.advantage_estimator`).

  Args:
    rewards: [prompts * num_generations] float, group-major (prompt j's answers are rows j*G ... j*G + G - 1).

  Returns:
    [prompts * num_generations] float32.
  """
  rewards = np.asarray(rewards, np.float64)
  if rewards.ndim != 1 or len(rewards) % num_generations:
    raise ValueError(
      f"rewards of shape {rewards.shape}: expected one reward per answer, prompts x num_generations={num_generations}."
    )
  groups = rewards.reshape(-1, num_generations)
  mean = groups.mean(axis=1, keepdims=True)
  if estimator == "grpo":
    advantages = (groups - mean) / (groups.std(axis=1, ddof=1, keepdims=True) + _STD_EPSILON)
  elif estimator == "drgrpo":
    advantages = groups - mean
  elif estimator == "rloo":
    advantages = groups - (groups.sum(axis=1, keepdims=True) - groups) / (num_generations - 1)
  else:
    raise ValueError(f"advantage_estimator={estimator!r}; choose one of {ADVANTAGE_ESTIMATORS}.")
  return advantages.reshape(-1).astype(np.float32)


def kl_estimate(logprobs: jax.Array, ref_logprobs: jax.Array, mode: str) -> jax.Array:
  """Per-token estimate of KL(pi || pi_ref) from the sampled token's log-probabilities ([batch, answer] each)."""
  diff = ref_logprobs - logprobs
  if mode == "low_var_kl":
    return jnp.exp(diff) - diff - 1.0
  if mode == "kl":
    return -diff
  if mode == "mse_kl":
    return 0.5 * jnp.square(diff)
  raise ValueError(f"kl_loss_mode={mode!r}; choose one of {KL_LOSS_MODES}.")


def aggregate(per_token: jax.Array, mask: jax.Array, mode: str, max_response_length: int = 0) -> jax.Array:
  """One number from [batch, answer] token values over the tokens `mask` keeps (`GRPOConfig.loss_agg_mode`)."""
  per_token, mask = per_token.astype(jnp.float32), mask.astype(jnp.float32)
  sums, counts = jnp.sum(per_token * mask, axis=-1), jnp.sum(mask, axis=-1)
  answers = jnp.maximum(jnp.sum(counts > 0), 1.0)  # answers with a token (a padding row has none)
  if mode == "token-mean":
    return jnp.sum(sums) / jnp.maximum(jnp.sum(counts), 1.0)
  if mode == "sequence-mean-token-mean":
    return jnp.sum(sums / jnp.maximum(counts, 1.0)) / answers
  if mode == "sequence-mean-token-scale":
    return jnp.sum(sums / (max_response_length or per_token.shape[-1])) / answers
  if mode == "seq-mean-token-sum":
    return jnp.sum(sums) / answers
  if mode == "sequence-mean-token-sum-norm":
    return jnp.sum(sums) / per_token.shape[0]
  raise ValueError(f"loss_agg_mode={mode!r}; choose one of {LOSS_AGG_MODES}.")


def grpo_loss(
  logprobs: jax.Array,
  old_logprobs: jax.Array,
  advantages: jax.Array,
  mask: jax.Array,
  config: GRPOConfig,
  ref_logprobs: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """GRPO's loss from per-token log-probabilities (the module docstring's formula).

  Args:
    logprobs: [batch, answer] float32, each token's log-probability under the policy being trained (differentiable).
    old_logprobs: [batch, answer], under the policy that sampled it (the rollout's own); any value off `mask`.
    advantages: [batch] (per answer) or [batch, answer].
    mask: [batch, answer], 1 on the tokens the loss counts.
    config: the clip, KL and aggregation settings.
    ref_logprobs: [batch, answer] under the reference policy; needed when `config.beta` > 0.

  Returns:
    The scalar loss and metrics: pg_loss, kl (the masked token mean, 0 without a reference), clip_fraction (tokens
    where the clipped term is the larger loss: tunix's pg_clipfrac), ratio_mean, ratio_max.
  """
  mask = mask.astype(jnp.float32)
  # Off the mask the inputs may be anything (NaN for "nothing committed"): replaced before they meet a product.
  logprobs = jnp.where(mask > 0, logprobs.astype(jnp.float32), 0.0)
  old_logprobs = jnp.where(mask > 0, old_logprobs.astype(jnp.float32), logprobs)
  advantages = advantages.astype(jnp.float32)
  advantages = advantages[:, None] if advantages.ndim == 1 else advantages
  log_ratio = jnp.clip(logprobs - jax.lax.stop_gradient(old_logprobs), -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
  ratio = jnp.exp(log_ratio)
  unclipped = -advantages * ratio
  clipped = -advantages * jnp.clip(ratio, 1.0 - config.epsilon, 1.0 + config.upper_epsilon)
  per_token = jnp.maximum(unclipped, clipped)
  tokens = jnp.maximum(jnp.sum(mask), 1.0)
  metrics = dict(
    pg_loss=aggregate(per_token, mask, config.loss_agg_mode, config.max_response_length),
    kl=jnp.zeros((), jnp.float32),
    clip_fraction=jnp.sum((clipped > unclipped) * mask) / tokens,
    ratio_mean=jnp.sum(ratio * mask) / tokens,
    ratio_max=jnp.max(jnp.where(mask > 0, ratio, 0.0)),
  )
  if ref_logprobs is not None:
    ref_logprobs = jnp.where(mask > 0, ref_logprobs.astype(jnp.float32), logprobs)
    kl = kl_estimate(logprobs, jax.lax.stop_gradient(ref_logprobs), config.kl_loss_mode)
    metrics["kl"] = jnp.sum(kl * mask) / tokens
    if config.beta:
      per_token = per_token + config.beta * kl
  elif config.beta:
    raise ValueError(f"GRPOConfig.beta={config.beta} needs the reference policy's log-probabilities (ref_logprobs).")
  loss = aggregate(per_token, mask, config.loss_agg_mode, config.max_response_length)
  return loss, dict(metrics, loss=loss)
