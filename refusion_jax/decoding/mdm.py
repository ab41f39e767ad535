"""The masked-diffusion baseline: LLaDA-style decoding with low-confidence remasking, on ReFusion's backbone.

No cache: every step is one bidirectional forward over prompt + answer. The
answer is decoded in semi-autoregressive blocks, and per step the most
confident masked tokens of the current block are unmasked (LLaDA's
`generate.py`). Batched and jitted end to end as one `lax` loop; the host side
is `refusion_jax.decoding.common.run_decoder`, whose `DecodeResult` records
`PHASE_STEP` for every token.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from refusion_jax.decoding.common import (
  DecodeOutputs,
  DecodeResult,
  check_special_id,
  check_temperature,
  counts_compilations,
  decoder_special_tokens,
  optional_eos_id,
  pick_tokens,
  run_decoder,
  step_outputs,
)
from refusion_jax.decoding.sharding import constrain_rows
from refusion_jax.model.transformer import Transformer


def num_transfer_tokens(block_length: int, steps_per_block: int) -> np.ndarray:
  """LLaDA's `get_num_transfer_tokens` for a fully masked block.

  Returns:
    [steps_per_block] tokens to unmask per step: an even split, with the
    remainder going to the first steps.
  """
  base, remainder = divmod(block_length, steps_per_block)
  counts = np.full(steps_per_block, base, np.int32)
  counts[:remainder] += 1
  return counts


def check_mdm_schedule(gen_length: int, block_length: int, steps: int) -> int:
  """Validate the block/step split; returns steps per block."""
  if block_length < 1 or gen_length % block_length:
    raise ValueError(
      f"gen_length={gen_length} must be a positive multiple of block_length={block_length}; "
      f"pick block_length among the divisors of gen_length."
    )
  num_blocks = gen_length // block_length
  if steps < 1 or steps % num_blocks:
    raise ValueError(
      f"steps={steps} must be a positive multiple of the number of blocks "
      f"(gen_length / block_length = {num_blocks}), so every block gets the same number of steps."
    )
  steps_per_block = steps // num_blocks
  if steps_per_block > block_length:
    raise ValueError(
      f"steps={steps} gives {steps_per_block} steps per block but a block has only "
      f"{block_length} tokens; use at most steps={block_length * num_blocks}."
    )
  return steps_per_block


@functools.partial(jax.jit, static_argnames=("graphdef", "gen_length", "block_length", "steps", "sample"))
@counts_compilations
def mdm_loop(
  graphdef: nnx.GraphDef,
  params: nnx.State,
  prompt: jax.Array,
  lengths: jax.Array,
  key: jax.Array,
  temperature: jax.Array,
  mask_id: jax.Array,
  *,
  gen_length: int,
  block_length: int,
  steps: int,
  sample: bool,
) -> DecodeOutputs:
  """All unmasking steps over a [prompt bucket | answer] sequence.

  The prompt keeps its right padding and the answer follows the bucket, but
  every token carries its true position (answer j sits at lengths + j) and
  no query sees padding, so with bidirectional attention this equals LLaDA's
  contiguous layout.

  Args:
    prompt: [B, P] right-padded prompt ids; lengths: [B].

  Returns:
    `DecodeOutputs`: answer [B, G], commit_iteration [B, G] the step that
    unmasked each offset, num_forwards = steps [B] = `steps` for every row.
  """
  model = nnx.merge(graphdef, params)
  batch, width = prompt.shape
  chex.assert_shape(lengths, (batch,))
  chex.assert_type([prompt, lengths], int)
  steps_per_block = steps // (gen_length // block_length)
  transfer_counts = jnp.asarray(num_transfer_tokens(block_length, steps_per_block))

  answer_positions = lengths[:, None] + jnp.arange(gen_length)[None, :]
  positions = jnp.concatenate([jnp.broadcast_to(jnp.arange(width), (batch, width)), answer_positions], 1)
  key_valid = jnp.concatenate([jnp.arange(width)[None, :] < lengths[:, None], jnp.ones((batch, gen_length), bool)], 1)
  mask = jnp.broadcast_to(key_valid[:, None, :], (batch, width + gen_length, width + gen_length))
  block_of = jnp.arange(gen_length) // block_length

  def body(step, carry):
    answer, committed_at = carry
    logits, _ = model(jnp.concatenate([prompt, answer], 1), positions, mask)
    draft, confidence = pick_tokens(logits[:, width:], key, step, temperature, sample)
    candidate = (answer == mask_id) & (block_of == step // steps_per_block)[None, :]
    confidence = jnp.where(candidate, confidence, -jnp.inf)
    # Rank by confidence (stable: ties go to the earlier position) and take the top k.
    order = jnp.argsort(-confidence, axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1)
    transfer = candidate & (rank < transfer_counts[step % steps_per_block])
    return jnp.where(transfer, draft, answer), jnp.where(transfer, step, committed_at)

  answer = jnp.full((batch, gen_length), mask_id, jnp.int32)
  committed_at = jnp.full((batch, gen_length), -1, jnp.int32)
  row_sharded_body = lambda step, carry: constrain_rows(body(step, carry))
  answer, committed_at = jax.lax.fori_loop(0, steps, row_sharded_body, constrain_rows((answer, committed_at)))
  return step_outputs(answer, committed_at, jnp.full((batch,), steps, jnp.int32))


def mdm_generate(
  model: Transformer,
  prompt_ids: Sequence[Sequence[int]],
  *,
  gen_length: int,
  block_length: int,
  steps: int,
  mask_id: int | None = None,
  eos_id: int | None = None,
  pad_id: int | None = None,
  temperature: float = 0.0,
  seed: int = 0,
  mesh: jax.sharding.Mesh | None = None,
) -> DecodeResult:
  """Batched LLaDA-style masked diffusion decoding with low-confidence remasking.

  The answer starts as G mask tokens, split into G / block_length blocks
  decoded left to right with steps / num_blocks steps each. Each step is one
  bidirectional forward over prompt + answer; of the current block's masked
  positions, the `num_transfer_tokens` most confident predictions are
  unmasked. Every row runs all `steps` forwards (as LLaDA does).

  Args:
    prompt_ids: B prompts of integer token ids.
    gen_length: G, a multiple of block_length.
    block_length: tokens per semi-autoregressive block.
    steps: total forwards, a multiple of the number of blocks and at most G.
    mask_id: defaults to the config's `mask_token_id`.
    eos_id: the answer is cut after its first EOS; defaults to the config's.
    pad_id: prompt padding id (never attended); defaults to the config's pad, else its EOS, else 0.
    temperature: 0 for greedy drafts, else Gumbel-max sampled drafts.
    mesh: decode on this mesh (`refusion_jax.make_mesh`); None: the default device.

  Returns:
    A `DecodeResult`; commit_iteration is the step that unmasked each position.
  """
  config = model.config
  check_mdm_schedule(gen_length, block_length, steps)
  temperature = check_temperature(temperature)
  mask = check_special_id("mask_id", decoder_special_tokens(config, mask_id=mask_id).mask, config)
  eos = optional_eos_id(eos_id, config)
  loop = functools.partial(
    mdm_loop,
    key=jax.random.key(seed),
    temperature=jnp.float32(temperature),
    mask_id=jnp.int32(mask),
    gen_length=gen_length,
    block_length=block_length,
    steps=steps,
    sample=temperature > 0,
  )
  return run_decoder(model, prompt_ids, loop, gen_length=gen_length, eos_id=eos, pad_id=pad_id, mesh=mesh)
