"""The two baselines ReFusion is compared against, on the same backbone.

- `ar_generate`: plain autoregressive decoding with the KV cache — one prompt
  prefill, then one forward per further token.
- `mdm_generate`: LLaDA-style masked diffusion decoding — no cache,
  bidirectional attention over prompt + answer, semi-autoregressive blocks,
  and per step the most confident masked tokens of the current block are
  unmasked ("low-confidence remasking", LLaDA's `generate.py`).

Both are batched, jitted end to end as one `lax` loop, take the prompt buckets
of `refusion_jax.decoding.common` so new prompts do not recompile, and return a
`DecodeResult` whose commit trace records `PHASE_STEP`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from refusion_jax.decoding.common import (
  PHASE_STEP,
  DecodeResult,
  answer_tokens,
  blank_after_answer,
  check_prompts,
  check_special_id,
  check_temperature,
  decoder_special_tokens,
  pad_prompts,
  row_gumbel_noise,
)
from refusion_jax.model import cache as kv_cache
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer

# An id no token has: "no EOS known" simply never matches.
_NO_TOKEN = -1


def _eos_and_pad(eos_id: int | None, pad_id: int | None, config: ModelConfig) -> tuple[int, int]:
  """Checked EOS and pad ids; the baselines run without an EOS (then `_NO_TOKEN`)."""
  ids = decoder_special_tokens(config, eos_id=eos_id, pad_id=pad_id)
  eos = _NO_TOKEN if ids.eos is None else check_special_id("eos_id", ids.eos, config)
  return eos, check_special_id("pad_id", ids.pad, config)


def pick_tokens(
  logits: jax.Array, key: jax.Array, step: jax.Array, temperature: jax.Array, sample: bool
) -> tuple[jax.Array, jax.Array]:
  """Greedy or Gumbel-max sampled tokens and their probabilities.

  Gumbel-max on `logits + temperature * gumbel` samples from
  softmax(logits / temperature), which is what LLaDA's `add_gumbel_noise`
  computes in another form. Row b at step s draws its noise from
  fold_in(fold_in(key, b), s), as the ReFusion decoder does. The returned
  probability is that of the chosen token under the un-noised softmax
  (LLaDA's confidence).

  Args:
    logits: [batch, length, vocab] float32.
    sample: False for greedy (argmax, first maximum); a static switch.

  Returns:
    tokens [batch, length] int32 and their probabilities [batch, length] float32.
  """
  scores = logits
  if sample:
    steps = jnp.broadcast_to(step, logits.shape[:1])
    scores = logits + temperature * row_gumbel_noise(key, steps, logits.shape[1:])
  tokens = jnp.argmax(scores, axis=-1).astype(jnp.int32)
  probs = jax.nn.softmax(logits, axis=-1)
  return tokens, jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]


# --------------------------------------------------------------------------- AR


@functools.partial(jax.jit, static_argnames=("graphdef", "gen_length", "sample"))
def _ar_loop(graphdef, state, prompt, lengths, key, temperature, eos_id, *, gen_length, sample):
  """Prefill + token-by-token decode.

  Args:
    prompt: [B, P] right-padded prompt ids; lengths: [B].

  Returns:
    out [B, G] tokens (0 after a row stopped), num_forwards [B].
  """
  model = nnx.merge(graphdef, state)
  batch, width = prompt.shape
  cache = kv_cache.KVCache.create(model.config, batch, width + gen_length)
  columns = jnp.arange(width)
  prompt_valid = columns[None, :] < lengths[:, None]

  causal = jnp.tril(jnp.ones((width, width), bool))[None] & prompt_valid[:, None, :]
  logits, kv = model(prompt, jnp.broadcast_to(columns, (batch, width)), causal)
  cache = kv_cache.append(cache, kv, jnp.broadcast_to(columns, (batch, width)), prompt_valid)
  last_logits = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
  first, _ = pick_tokens(last_logits[:, None], key, 0, temperature, sample)
  first = first[:, 0]

  out = jnp.zeros((batch, gen_length), jnp.int32).at[:, 0].set(first)
  done = first == eos_id
  forwards = jnp.ones((batch,), jnp.int32)

  def cond(carry):
    step, _, _, _, done = carry
    return (step < gen_length) & ~jnp.all(done)

  def body(carry):
    step, cache, out, forwards, done = carry
    fed = out[:, step - 1][:, None]
    positions = (lengths + step - 1)[:, None]
    mask = kv_cache.block_mask(cache, jnp.ones((batch, 1, 1), bool))
    logits, kv = model(fed, positions, mask, cache)
    cache = kv_cache.append(cache, kv, positions, ~done[:, None])
    token, _ = pick_tokens(logits, key, step, temperature, sample)
    token = token[:, 0]
    live = ~done
    out = out.at[:, step].set(jnp.where(live, token, out[:, step]))
    forwards = forwards + live
    done = done | (token == eos_id)
    return step + 1, cache, out, forwards, done

  _, _, out, forwards, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), cache, out, forwards, done))
  return out, forwards


def ar_generate(
  model: Transformer,
  prompt_ids: Sequence[Sequence[int]],
  *,
  gen_length: int,
  temperature: float = 0.0,
  seed: int = 0,
  eos_id: int | None = None,
  pad_id: int | None = None,
) -> DecodeResult:
  """Batched autoregressive decoding with the KV cache.

  The prompt prefill is one forward and yields the first token; each further
  token costs one forward of the previous token. A row stops at its first EOS;
  the loop ends when every row has stopped or G tokens exist.

  Args:
    prompt_ids: B prompts of token ids (any lengths).
    gen_length: G, the most tokens to generate per row.
    temperature: 0 for greedy, else Gumbel-max sampling at that temperature.
    eos_id: stop token; defaults to the model config's, none if that is unset.
    pad_id: prompt padding id (never attended); defaults to the config's pad, else its EOS, else 0.

  Returns:
    A `DecodeResult`: num_forwards = steps = answer tokens per row (prefill
    included), commit_iteration[b, t] = t.
  """
  config = model.config
  check_prompts(prompt_ids, config, gen_length)
  temperature = check_temperature(temperature)
  eos, pad = _eos_and_pad(eos_id, pad_id, config)

  start = time.perf_counter()
  prompt, lengths = pad_prompts(prompt_ids, pad)
  graphdef, state = nnx.split(model)
  out, forwards = _ar_loop(
    graphdef,
    state,
    prompt,
    lengths,
    jax.random.key(seed),
    jnp.float32(temperature),
    jnp.int32(eos),
    gen_length=gen_length,
    sample=temperature > 0,
  )
  out, forwards = np.asarray(out), np.asarray(forwards)
  seconds = time.perf_counter() - start

  answers = answer_tokens(out, eos)
  iteration, phase = blank_after_answer(
    answers, np.broadcast_to(np.arange(gen_length), out.shape), np.full(out.shape, PHASE_STEP)
  )
  return DecodeResult(
    tokens=answers,
    num_forwards=forwards,
    steps=forwards.copy(),
    commit_iteration=iteration,
    commit_phase=phase,
    seconds=seconds,
  )


# -------------------------------------------------------------------------- MDM


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
def _mdm_loop(graphdef, state, prompt, lengths, key, temperature, mask_id, *, gen_length, block_length, steps, sample):
  """All unmasking steps over a [prompt bucket | answer] sequence.

  The prompt keeps its right padding and the answer follows the bucket, but
  every token carries its true position (answer j sits at lengths + j) and
  no query sees padding, so with bidirectional attention this equals LLaDA's
  contiguous layout.

  Returns:
    answer [B, G] ids and commit step [B, G].
  """
  model = nnx.merge(graphdef, state)
  batch, width = prompt.shape
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
  return jax.lax.fori_loop(0, steps, body, (answer, committed_at))


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
) -> DecodeResult:
  """Batched LLaDA-style masked diffusion decoding with low-confidence remasking.

  The answer starts as G mask tokens, split into G / block_length blocks
  decoded left to right with steps / num_blocks steps each. Each step is one
  bidirectional forward over prompt + answer; of the current block's masked
  positions, the `num_transfer_tokens` most confident predictions are
  unmasked. Every row runs all `steps` forwards (as LLaDA does).

  Args:
    prompt_ids: B prompts of token ids.
    gen_length: G, a multiple of block_length.
    block_length: tokens per semi-autoregressive block.
    steps: total forwards, a multiple of the number of blocks and at most G.
    mask_id: defaults to the config's `mask_token_id`.
    eos_id: the answer is cut after its first EOS; defaults to the config's.
    pad_id: prompt padding id (never attended); defaults to the config's pad, else its EOS, else 0.
    temperature: 0 for greedy drafts, else Gumbel-max sampled drafts.

  Returns:
    A `DecodeResult`; commit_iteration is the step that unmasked each position.
  """
  config = model.config
  check_prompts(prompt_ids, config, gen_length)
  check_mdm_schedule(gen_length, block_length, steps)
  temperature = check_temperature(temperature)
  mask = check_special_id("mask_id", decoder_special_tokens(config, mask_id=mask_id).mask, config)
  eos, pad = _eos_and_pad(eos_id, pad_id, config)

  start = time.perf_counter()
  prompt, lengths = pad_prompts(prompt_ids, pad)
  graphdef, state = nnx.split(model)
  answer, committed_at = _mdm_loop(
    graphdef,
    state,
    prompt,
    lengths,
    jax.random.key(seed),
    jnp.float32(temperature),
    jnp.int32(mask),
    gen_length=gen_length,
    block_length=block_length,
    steps=steps,
    sample=temperature > 0,
  )
  answer, committed_at = np.asarray(answer), np.asarray(committed_at)
  seconds = time.perf_counter() - start

  batch = len(prompt_ids)
  answers = answer_tokens(answer, eos)
  iteration, phase = blank_after_answer(answers, committed_at, np.full(committed_at.shape, PHASE_STEP))
  return DecodeResult(
    tokens=answers,
    num_forwards=np.full(batch, steps, np.int32),
    steps=np.full(batch, steps, np.int32),
    commit_iteration=iteration,
    commit_phase=phase,
    seconds=seconds,
  )


def compile_count() -> int:
  """Compilations the baseline loops have done so far (both baselines together)."""
  return _ar_loop._cache_size() + _mdm_loop._cache_size()
