"""Each recorded answer token's log-probability under the current weights, differentiably: what GRPO's ratio reads.

A rollout (`RolloutBatch`) records, per answer, the tokens its decoder committed and when. The policy's
probability of a token depends on the method that drew it:

- AR (`ar_logprobs`): token t is drawn from softmax(logits / T) given the prompt and tokens < t, so one
  teacher-forced causal forward over [prompt][answer] gives every token's log-probability (TRL's and tunix's
  `get_per_token_logps`, at true positions: a left-padded prompt's positions start at 0);
- ReFusion with speculative acceptance: a slot's first token from the plan distribution, its other tokens from
  the AR distribution given the slot's earlier tokens, in commit order (docs/rl.md §1); `replay.py`'s
  `trajectory_logprobs` replays the whole trajectory in one forward.

`policy_logprobs` picks the one of the objective's kind. Neither materialises [batch, length, vocab] logits
(`training.cross_entropy.token_log_probs` walks the answer in chunks).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from refusion_jax.training.cross_entropy import token_log_probs


@flax.struct.dataclass
class RolloutBatch:
  """A step's answers as the update reads them (R = prompts x num_generations rows, group-major; G = gen_length).

  prompt:        [R, P] int32, each prompt's tokens left-padded to the prompt width P (pad id before them).
  prompt_len:    [R] int32, the prompt's true length.
  tokens:        [R, G] int32, the committed trajectory by answer position (`Rollout.tokens`: -1 where nothing
                 was committed; ReFusion's may extend past the EOS, uncut).
  iteration:     [R, G] int32, the iteration that committed each token (-1 none).
  phase:         [R, G] int32, how it was committed (`result.PHASE_*`).
  old_logprobs:  [R, G] float32, each token's log-probability under the policy that drew it (NaN where none).
  mask:          [R, G] float32, 1 on the tokens the loss counts (the committed ones).
  advantages:    [R] float32, each answer's group-relative advantage.
  ref_logprobs:  [R, G] float32 under the reference policy (when GRPO's beta > 0; zeros otherwise).
  """

  prompt: jax.Array
  prompt_len: jax.Array
  tokens: jax.Array
  iteration: jax.Array
  phase: jax.Array
  old_logprobs: jax.Array
  mask: jax.Array
  advantages: jax.Array
  ref_logprobs: jax.Array


def ar_logprobs(
  model: nnx.Module,
  prompt: jax.Array,
  prompt_len: jax.Array,
  tokens: jax.Array,
  *,
  temperature: float = 1.0,
  chunk: int = 0,
  dropout_key: jax.Array | None = None,
) -> jax.Array:
  """Each answer token's log softmax(logits / temperature) given the prompt and the answer's earlier tokens.

  Args:
    model: the backbone (a `Transformer`, LoRA adapters and all).
    prompt: [B, P] int32 prompts left-padded to P.
    prompt_len: [B] int32 true prompt lengths (>= 1).
    tokens: [B, G] int32 answers; -1 past an answer's end (those get log-probabilities of token 0: mask them).
    temperature: the sampling temperature (<= 0 reads as 1: greedy takes the mode of the model's own distribution).
    chunk: answer tokens whose logits exist at once (0: all).
    dropout_key: the LoRA adapters' dropout (training); None: none.

  Returns:
    [B, G] float32.
  """
  width = prompt.shape[1]
  answer = jnp.maximum(tokens, 0)
  sequence = jnp.concatenate([prompt, answer], axis=1)
  index = jnp.arange(sequence.shape[1], dtype=jnp.int32)[None]
  start = (width - prompt_len)[:, None]
  real = (index >= start) & jnp.concatenate([jnp.ones_like(prompt, bool), tokens >= 0], axis=1)
  positions = jnp.maximum(index - start, 0)
  hidden, _ = model.features(sequence, positions, segment_ids=real.astype(jnp.int32), dropout_key=dropout_key)
  # The hidden state before each answer token predicts it: the last prompt token's, then the answer's own.
  before = jax.lax.dynamic_slice_in_dim(hidden, width - 1, tokens.shape[1], axis=1)
  temperature = temperature if temperature > 0 else 1.0
  return token_log_probs(model.logits, before, answer, temperature=temperature, chunk=chunk)


def policy_logprobs(
  model: nnx.Module,
  batch: RolloutBatch,
  kind: str,
  *,
  temperature: float,
  chunk: int = 0,
  dropout_key: jax.Array | None = None,
) -> jax.Array:
  """[R, G] float32: each recorded token's log-probability under `model` as the method `kind` ("ar" or
  "refusion": speculative acceptance) draws it."""
  if kind == "ar":
    return ar_logprobs(
      model,
      batch.prompt,
      batch.prompt_len,
      batch.tokens,
      temperature=temperature,
      chunk=chunk,
      dropout_key=dropout_key,
    )
  if kind == "refusion":
    from refusion_jax.rl import replay  # noqa: PLC0415 (its own module, being written beside this one)

    return replay.trajectory_logprobs(model, batch, temperature=temperature, chunk=chunk, dropout_key=dropout_key)
  raise ValueError(
    f"GRPO trains the policy of the 'ar' or 'refusion' objective, not {kind!r} (an MDM answer has no tractable "
    "probability): set config.objective.kind."
  )
