"""Training objectives: ReFusion's slot reordering (docs/method.md §1) and the AR / MDM baselines.

Every objective is one forward of the backbone over a [batch, length] layout
built from the batch, and one cross entropy with two kinds of labelled tokens:

- AR-labelled tokens: loss averaged over every such token of the batch;
- MDM-labelled (masked) tokens: CE / p / answer_length, summed and divided by
  the number of examples.

| kind       | layout (per example)                                | AR labels           | MDM labels    | attention   |
| ---------- | --------------------------------------------------- | ------------------- | ------------- | ----------- |
| `refusion` | prompt, clean slots shuffled, masked slots in order | next token in slot  | masked tokens | causal      |
| `ar`       | unchanged                                           | next answer token   | none          | causal      |
| `mdm`      | answer EOS-padded to the row's end, tokens masked   | none                | masked tokens | full (real) |
|            | one by one w.p. p                                   |                     |               |             |

A row may hold several examples back to back (packed rows, docs/method.md
§1): each is laid out inside its own span with its own draws, its positions
start at 0, and it attends only to itself (segment ids). Both normalisers
count tokens and examples, never rows, so a packed batch has the loss of the
same examples unpacked with the same draws. "mdm" answers run to the row's
end, so its rows hold one example each.

All randomness comes from `draw_randomness`; `build_inputs` is deterministic
given the draws, which lets tests replay the same draws in a plain NumPy
transcription of docs/method.md §1. Shapes are static and there is no
per-example Python loop: the reordering is one lexicographic sort per row.
The loss never needs [batch, length, vocab] logits
(`refusion_jax.training.cross_entropy`, `ObjectiveConfig.loss_chunk`).

Batch contract (from the data pipeline): a dict with
  tokens:     [batch, length] int32; each row holds its examples back to back
              from its start, each its prompt then its answer (response +
              EOS); the rest of the row is padding (any ids);
  prompt_len: [batch, segments] int32, per example of the row (or [batch]
              for one example per row: segments = 1);
  answer_len: [batch, segments] int32, EOS included; 0 marks an unused
              segment (and a padding row of a partial batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from refusion_jax.training.cross_entropy import weighted_cross_entropy

ObjectiveKind = Literal["refusion", "ar", "mdm"]
_KINDS = ("refusion", "ar", "mdm")

# Sort groups of the ReFusion storage order (within an example).
_PROMPT, _CLEAN, _MASKED, _PADDING = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObjectiveConfig:
  """Which objective to train and its constants. Hashable: a static jit argument.

  Attributes:
    kind: "refusion" (docs/method.md §1), "ar" (next-token baseline) or "mdm"
      (LLaDA-style token-level masked diffusion baseline).
    slot_sizes: ReFusion draws each example's slot size S uniformly from these.
    eps: the masking probability is p = (1 - eps) t + eps with t ~ U(0, 1).
    mask_id: token id fed in place of a masked token.
    pad_id: token id written into padding.
    eos_id: end-of-answer token; "mdm" pads every answer with it to the end of
      the row (required there, unused otherwise).
    loss_chunk: tokens of length whose logits exist at once in the loss
      (`refusion_jax.training.cross_entropy`); 0 computes all logits at once.
  """

  kind: ObjectiveKind
  mask_id: int
  pad_id: int
  eos_id: int | None = None
  slot_sizes: tuple[int, ...] = (4, 8, 16, 32)
  eps: float = 1e-3
  loss_chunk: int = 256

  def __post_init__(self):
    if self.kind not in _KINDS:
      raise ValueError(f"ObjectiveConfig.kind={self.kind!r}; expected one of {_KINDS}.")
    object.__setattr__(self, "slot_sizes", tuple(int(s) for s in self.slot_sizes))
    if not self.slot_sizes or min(self.slot_sizes) < 1:
      raise ValueError(f"slot_sizes={self.slot_sizes}; give a non-empty tuple of positive ints.")
    if not 0.0 < self.eps <= 1.0:
      raise ValueError(f"eps={self.eps}; it must lie in (0, 1] so that p > 0 (the MDM term divides by p).")
    if self.kind == "mdm" and self.eos_id is None:
      raise ValueError("The mdm objective pads answers with EOS (as LLaDA does); set ObjectiveConfig.eos_id.")
    if not isinstance(self.loss_chunk, (int, np.integer)) or self.loss_chunk < 0:
      raise ValueError(f"loss_chunk={self.loss_chunk!r}; give tokens per chunk (an int >= 0; 0 = all at once).")
    for field in ("mask_id", "pad_id", "eos_id"):
      value = getattr(self, field)
      if field == "eos_id" and value is None:
        continue
      if not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"ObjectiveConfig.{field}={value!r}; set it to a token id (an int >= 0).")


@flax.struct.dataclass
class Draws:
  """Every random number an objective uses, drawn up front, per example.

  slot_size:    [batch, segments] int32, ReFusion's slot size S of each example.
  t:            [batch, segments] float32, t ~ U(0, 1) per example; the masking
                probability is `mask_probability(t, eps)`.
  mask_uniform: [batch, length] float32 ~ U(0, 1). Unit k of an example (its
                k-th slot for ReFusion, its k-th answer token for MDM) reads
                the column of the example's k-th answer token: it is masked
                iff mask_uniform[b, answer_start + k] < p.
  slot_rank:    [batch, length] int32, a random permutation of 0..length-1 per
                row; ReFusion stores an example's clean slots by increasing
                rank, read at the same columns as mask_uniform.

  An example has no more units than answer tokens, so its per-unit draws lie
  in its own span of the row: an example moved to another row or place, its
  span of draws with it, is laid out identically.
  """

  slot_size: jax.Array
  t: jax.Array
  mask_uniform: jax.Array
  slot_rank: jax.Array


@flax.struct.dataclass
class TrainingInputs:
  """What the backbone is fed and what its logits are scored against.

  All per-token fields are in *storage order* (the order the model sees).

  tokens:        [batch, length] int32, fed tokens (masked ones = mask_id, padding = pad_id).
  positions:     [batch, length] int32, true RoPE positions within the example (0 on padding).
  labels:        [batch, length] int32, target of each labelled token (0 elsewhere).
  ar_weights:    [batch, length] float32, 1 where the token has an AR label.
  mdm_weights:   [batch, length] float32, 1 / (p * answer_len) where the token has an MDM label.
  segment_ids:   [batch, length] int32, 1 + the index of the token's example in its row; 0 on padding.
  real_examples: [batch, segments] bool, examples with an answer (answer_len > 0).
  p:             [batch, segments] float32, masking probability (0 for "ar").
  slot_size:     [batch, segments] int32, masking unit (ReFusion's S; 1 for "mdm"; 0 for "ar").
  """

  tokens: jax.Array
  positions: jax.Array
  labels: jax.Array
  ar_weights: jax.Array
  mdm_weights: jax.Array
  segment_ids: jax.Array
  real_examples: jax.Array
  p: jax.Array
  slot_size: jax.Array

  @property
  def valid(self) -> jax.Array:
    """[batch, length] bool, prompt and answer tokens (not padding)."""
    return self.segment_ids > 0


def mask_probability(t: jax.Array, eps: float) -> jax.Array:
  """p = (1 - eps) t + eps, so that p never reaches 0."""
  return (1.0 - eps) * t + eps


def draw_randomness(key: jax.Array, batch_size: int, length: int, config: ObjectiveConfig, segments: int = 1) -> Draws:
  """Draw all randomness of one batch of `segments` examples per row (see `Draws` for each field)."""
  size_key, t_key, mask_key, rank_key = jax.random.split(key, 4)
  ranks = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch_size, length))
  return Draws(
    slot_size=jax.random.choice(size_key, jnp.asarray(config.slot_sizes, jnp.int32), (batch_size, segments)),
    t=jax.random.uniform(t_key, (batch_size, segments), jnp.float32),
    mask_uniform=jax.random.uniform(mask_key, (batch_size, length), jnp.float32),
    slot_rank=jax.random.permutation(rank_key, ranks, axis=1, independent=True),
  )


def _check_batch(batch: Mapping[str, jax.Array]) -> None:
  missing = {"tokens", "prompt_len", "answer_len"} - set(batch)
  if missing:
    raise ValueError(f"Batch lacks {sorted(missing)}; expected keys tokens, prompt_len, answer_len.")
  tokens, prompt_len, answer_len = batch["tokens"], batch["prompt_len"], batch["answer_len"]
  try:
    chex.assert_rank(tokens, 2)
    chex.assert_equal_shape([prompt_len, answer_len])
    chex.assert_rank(prompt_len, {1, 2})
    chex.assert_axis_dimension(prompt_len, 0, tokens.shape[0])
    chex.assert_type([tokens, prompt_len, answer_len], int)
  except AssertionError as error:
    raise ValueError(
      f"Batch tokens {tokens.shape} {tokens.dtype}, prompt_len {prompt_len.shape} {prompt_len.dtype}, answer_len "
      f"{answer_len.shape} {answer_len.dtype}: expected integer tokens [batch, length] and integer prompt_len, "
      f"answer_len of one shape, [batch, segments] or [batch] ({error})."
    ) from None
  # Values can only be checked on concrete host arrays, not under a trace.
  if isinstance(prompt_len, np.ndarray) and isinstance(answer_len, np.ndarray):
    if (prompt_len < 0).any() or (answer_len < 0).any():
      raise ValueError("prompt_len and answer_len must be non-negative.")
    used = (prompt_len + answer_len).reshape(len(prompt_len), -1).sum(1)
    if (used > tokens.shape[1]).any():
      raise ValueError(
        f"Some rows have prompt_len + answer_len (summed over their examples) > length={tokens.shape[1]}; "
        "truncate them or pad the batch to a longer length."
      )


def _gather(x: jax.Array, order: jax.Array) -> jax.Array:
  return jnp.take_along_axis(x, order, axis=1)


def _as_segments(batch: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
  """tokens [batch, length], prompt_len and answer_len [batch, segments] (segments = 1 for [batch] lengths)."""
  prompt_len, answer_len = (jnp.asarray(batch[key], jnp.int32) for key in ("prompt_len", "answer_len"))
  if prompt_len.ndim == 1:
    prompt_len, answer_len = prompt_len[:, None], answer_len[:, None]
  return jnp.asarray(batch["tokens"], jnp.int32), prompt_len, answer_len


def _pad_answers_with_eos(
  tokens: jax.Array, index: jax.Array, prompt_len: jax.Array, answer_len: jax.Array, eos_id: int
) -> tuple[jax.Array, jax.Array]:
  """LLaDA's answers: every real row's answer runs to the end of the row, EOS after the real one.

  An MDM decoder fills a masked window of a fixed length G, so the model must
  learn to answer EOS where the answer is over; trained only on the exact
  answer span it never sees a window longer than its answer (docs/method.md §1).
  Takes and returns one example per row: prompt_len, answer_len [batch, 1]
  (length - prompt_len on real rows, 0 on padding rows).
  """
  real = answer_len > 0
  tokens = jnp.where(real & (index >= prompt_len + answer_len), eos_id, tokens)
  return tokens, jnp.where(real, tokens.shape[1] - prompt_len, 0)


def build_inputs(batch: Mapping[str, jax.Array], draws: Draws, config: ObjectiveConfig) -> TrainingInputs:
  """Lay the batch out for `config.kind` using the given draws (deterministic).

  Args:
    batch: tokens [batch, length], prompt_len and answer_len [batch, segments] (or [batch]).
    draws: from `draw_randomness(key, batch, length, config, segments)`.
    config: the objective.

  Returns:
    `TrainingInputs` in storage order.
  """
  _check_batch(batch)
  tokens, prompt_len, answer_len = _as_segments(batch)
  batch_size, length = tokens.shape
  segments = prompt_len.shape[1]
  index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch_size, length))
  if config.kind == "mdm":
    if segments > 1:
      raise ValueError(
        f"The mdm objective runs every answer to the row's end, so a row holds one example, not {segments} "
        "(docs/method.md §1): give prompt_len and answer_len as [batch] or [batch, 1] (config.data.packing=False)."
      )
    tokens, answer_len = _pad_answers_with_eos(tokens, index, prompt_len, answer_len, config.eos_id)

  # Which example each column holds: examples sit back to back from the row's start, so it is the number of
  # examples ending at or before the column (`segments` past the last one: padding).
  end = jnp.cumsum(prompt_len + answer_len, axis=1)
  start = end - prompt_len - answer_len
  segment = jnp.sum(index[:, :, None] >= end[:, None, :], axis=-1, dtype=jnp.int32)
  valid = segment < segments

  def per_token(per_example: jax.Array) -> jax.Array:  # [batch, segments] -> [batch, length]
    return _gather(per_example, jnp.minimum(segment, segments - 1))

  local = index - per_token(start)  # the true position inside the example
  example_prompt, example_answer = per_token(prompt_len), per_token(answer_len)
  is_prompt = valid & (local < example_prompt)
  is_answer = valid & ~is_prompt
  answer_offset = jnp.where(is_answer, local - example_prompt, 0)
  # Token at index + 1; read only where it is in the same example.
  next_token = jnp.roll(tokens, -1, axis=1)
  zeros = jnp.zeros((batch_size, segments), jnp.int32)

  if config.kind == "ar":
    p, unit_size = jnp.zeros((batch_size, segments), jnp.float32), zeros
    token_p = jnp.zeros((batch_size, length), jnp.float32)
    masked = jnp.zeros_like(valid)
    ar_labelled = valid & (local + 1 >= example_prompt) & (local + 1 < example_prompt + example_answer)
  else:
    p = mask_probability(draws.t, config.eps)
    unit_size = draws.slot_size if config.kind == "refusion" else zeros + 1
    token_p, size = per_token(p), per_token(unit_size)
    unit = answer_offset // size
    # The draws of unit k sit at the example's k-th answer column (see `Draws`).
    draw_column = index - answer_offset + unit
    masked = is_answer & (_gather(draws.mask_uniform, draw_column) < token_p)
    if config.kind == "refusion":
      offset_in_slot = answer_offset % size
      ar_labelled = is_answer & ~masked & (offset_in_slot + 1 < size) & (answer_offset + 1 < example_answer)
    else:
      ar_labelled = jnp.zeros_like(valid)

  fed = jnp.where(masked, config.mask_id, jnp.where(valid, tokens, config.pad_id))
  labels = jnp.where(ar_labelled, next_token, jnp.where(masked, tokens, 0))
  mdm_weights = jnp.where(masked, 1.0 / (token_p * jnp.maximum(example_answer, 1)), 0.0)
  segment_ids = jnp.where(valid, segment + 1, 0)

  if config.kind == "refusion":
    # Storage order = lexicographic sort on (example, group, rank within group, offset in slot): each example
    # stays in its own span. A clean slot's tokens share its random rank and stay contiguous; prompt, masked and
    # padding tokens keep their original order.
    group = jnp.where(is_prompt, _PROMPT, jnp.where(masked, _MASKED, jnp.where(is_answer, _CLEAN, _PADDING)))
    clean = group == _CLEAN
    within_group = jnp.where(clean, _gather(draws.slot_rank, draw_column), index)
    order = jnp.lexsort((jnp.where(clean, offset_in_slot, 0), within_group, group, segment), axis=-1)
    fed, labels, ar_labelled, mdm_weights, segment_ids, local = (
      _gather(x, order) for x in (fed, labels, ar_labelled, mdm_weights, segment_ids, local)
    )

  return TrainingInputs(
    tokens=fed,
    positions=jnp.where(segment_ids > 0, local, 0).astype(jnp.int32),
    labels=labels.astype(jnp.int32),
    ar_weights=ar_labelled.astype(jnp.float32),
    mdm_weights=mdm_weights.astype(jnp.float32),
    segment_ids=segment_ids.astype(jnp.int32),
    real_examples=answer_len > 0,
    p=p,
    slot_size=unit_size,
  )


def reorganize(batch: Mapping[str, jax.Array], key: jax.Array, config: ObjectiveConfig) -> TrainingInputs:
  """Draw the randomness from `key` and lay the batch out (docs/method.md §1 steps 1-4 for "refusion")."""
  _check_batch(batch)
  _, prompt_len, _ = _as_segments(batch)
  batch_size, length = batch["tokens"].shape
  return build_inputs(batch, draw_randomness(key, batch_size, length, config, prompt_len.shape[1]), config)


def _features(
  model: nnx.Module, inputs: TrainingInputs, config: ObjectiveConfig, dropout_key: jax.Array | None = None
) -> jax.Array:
  """Hidden states [batch, length, embed] of the objective's forward.

  Attention stays inside each example (`segment_ids`; padding sees only
  padding and carries no label): causal over storage order, or full for "mdm".
  `dropout_key`: the LoRA adapters' dropout (training only).
  """
  hidden, _ = model.features(
    inputs.tokens,
    inputs.positions,
    segment_ids=inputs.segment_ids,
    bidirectional=config.kind == "mdm",
    dropout_key=dropout_key,
  )
  return hidden


def forward(model: nnx.Module, inputs: TrainingInputs, config: ObjectiveConfig) -> jax.Array:
  """Logits [batch, length, vocab] float32 of the objective's forward (the loss never builds them)."""
  return model.logits(_features(model, inputs, config))


def loss_from_inputs(
  model: nnx.Module, inputs: TrainingInputs, config: ObjectiveConfig, dropout_key: jax.Array | None = None
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Loss = AR CE averaged over AR-labelled tokens + sum(CE / p / answer_len) over masked tokens / examples.

  Returns:
    The scalar loss and metrics {loss, ar_loss, mdm_loss, num_ar_tokens, num_mdm_tokens, num_examples}.
  """
  weights = jnp.stack([inputs.ar_weights, inputs.mdm_weights])
  ar_sum, mdm_sum = weighted_cross_entropy(
    model.logits, _features(model, inputs, config, dropout_key), inputs.labels, weights, chunk=config.loss_chunk
  )
  num_ar = jnp.sum(inputs.ar_weights)
  num_examples = jnp.sum(inputs.real_examples.astype(jnp.float32))
  # max(., 1): a batch without AR-labelled tokens (or without examples) gives 0, not NaN.
  ar_loss = ar_sum / jnp.maximum(num_ar, 1.0)
  mdm_loss = mdm_sum / jnp.maximum(num_examples, 1.0)
  loss = ar_loss + mdm_loss
  metrics = dict(
    loss=loss,
    ar_loss=ar_loss,
    mdm_loss=mdm_loss,
    num_ar_tokens=num_ar,
    num_mdm_tokens=jnp.sum((inputs.mdm_weights > 0).astype(jnp.float32)),
    num_examples=num_examples,
  )
  return loss, metrics


def loss_fn(
  model: nnx.Module,
  batch: Mapping[str, jax.Array],
  key: jax.Array,
  config: ObjectiveConfig,
  dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The training loss of one batch: `reorganize` then `loss_from_inputs` (`dropout_key`: LoRA dropout).

  Jit it with the config static, e.g.
  `nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True), static_argnames="config")`.
  """
  return loss_from_inputs(model, reorganize(batch, key, config), config, dropout_key)
