"""A step's rollouts as GRPO's update reads them, and their log-probabilities under the weights being trained.

`RolloutBatch` holds a step's answers (prompts left-padded, the committed trajectories, the old and reference
log-probabilities, the advantages); `policy_logprobs` replays them under the current weights in one
differentiable forward per answer (`replay.trajectory_logprobs`, docs/rl.md §2): AR's [prompt][answer] with the
shift (TRL's and tunix's per-token log-probabilities, at true positions), speculative ReFusion's trajectory in
commit order. Neither builds [rows, length, vocab] logits.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
from flax import nnx

from refusion_jax.rl.replay import Trajectory, trajectory_logprobs


@flax.struct.dataclass
class RolloutBatch:
  """A step's answers as the update reads them (R = prompts x num_generations rows, group-major; G = gen_length).

  prompt:        [R, P] int32, each prompt's tokens left-padded to the prompt width P (pad id before them).
  prompt_len:    [R] int32, the prompt's true length.
  tokens:        [R, G] int32, the committed trajectory by answer position (`Rollout.tokens`: -1 where nothing
                 was committed; ReFusion's may extend past the EOS, uncut).
  iteration:     [R, G] int32, the iteration that committed each token (-1 none).
  old_logprobs:  [R, G] float32, each token's log-probability under the policy that drew it (NaN where none).
  mask:          [R, G] float32, 1 on the tokens the loss counts (the committed ones).
  advantages:    [R] float32, each answer's group-relative advantage.
  ref_logprobs:  [R, G] float32 under the reference policy (when GRPO's beta > 0; zeros otherwise).
  """

  prompt: jax.Array
  prompt_len: jax.Array
  tokens: jax.Array
  iteration: jax.Array
  old_logprobs: jax.Array
  mask: jax.Array
  advantages: jax.Array
  ref_logprobs: jax.Array


def policy_logprobs(
  model: nnx.Module,
  batch: RolloutBatch,
  method: Any,
  *,
  temperature: float,
  mask_id: int | None = None,
  eos_id: int | None = None,
  chunk: int = 256,
  dropout_key: jax.Array | None = None,
) -> jax.Array:
  """[R, G] float32: each recorded token's log-probability under `model` as `method` (`rj.AR` or speculative
  `rj.ReFusion`, the rollout's) draws it at `temperature`; NaN where nothing was committed."""
  return trajectory_logprobs(
    model,
    batch.prompt,
    batch.prompt_len,
    Trajectory(batch.tokens, batch.iteration),
    method,
    temperature=temperature,
    mask_id=mask_id,
    eos_id=eos_id,
    chunk=chunk,
    prompt_padding="left",
    dropout_key=dropout_key,
  )
