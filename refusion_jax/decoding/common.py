"""What every decoder shares: input checks, prompt buckets, the prefill, the host-side front end.

ReFusion (`refusion_jax.decoding.refusion`), its eager reference and the AR / MDM
baselines (`refusion_jax.decoding.ar`, `refusion_jax.decoding.mdm`) all take
token-id prompts, reject bad input before anything is compiled, pad prompts
into a few length buckets so new prompts do not recompile, and return a
`DecodeResult`. The jitted decoders share more: `run_decoder` is their one
host-side front end (check, pad, start the rows, run the compiled loop over a
`batching.Batch`, read the answers back), `prefill` their one prompt forward,
and `counts_compilations` their one compile counter (docs/method.md §3).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from refusion_jax.data.special_tokens import SpecialTokens, resolve_special_tokens
from refusion_jax.decoding.batching import PHASE_INFILL, PHASE_NONE, PHASE_STEP, PHASE_VERIFY, Batch, DecodeOutputs
from refusion_jax.decoding.sharding import constrain_cache, pad_rows, sharded_loop
from refusion_jax.model import cache as kv_cache
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import Transformer, inference_view
from refusion_jax.parallel.sharding import batch_parallel_ways

# Prompt lengths are padded up to the smallest bucket that holds them.
PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

# Phase codes recorded in `DecodeResult.commit_phase` (`batching.PHASE_*`).
__all__ = ["PHASE_INFILL", "PHASE_NONE", "PHASE_STEP", "PHASE_VERIFY", "DecodeOutputs"]
PHASE_NAMES = {PHASE_VERIFY: "verify", PHASE_INFILL: "infill", PHASE_STEP: "step"}


@dataclasses.dataclass
class DecodeResult:
  """The output of a decode call over a batch of B prompts.

  Attributes:
    tokens: per row, the generated answer read back by true position, up to and
      including the first EOS (the whole generation when there is none).
    num_forwards: [B] model forwards each row took part in before it finished.
    steps: [B] decode iterations per row (ReFusion: plan steps; AR: tokens;
      MDM: unmasking steps).
    commit_iteration: [B, G] the iteration (0-based) that committed each
      answer position, -1 where nothing was committed.
    commit_phase: [B, G] how each position was committed (`PHASE_*`).
    seconds: wall-clock time of the call, compilation included when it happened.
    widths: name -> {query width: count}. "forward" counts the batched loop
      forwards (prefills not included) by their query width (tokens per row);
      ReFusion adds one entry per stage ("plan", "verify", "draft", "check")
      counting each row's forwards in that stage by the width they ran at.
  """

  tokens: list[list[int]]
  num_forwards: np.ndarray
  steps: np.ndarray
  commit_iteration: np.ndarray
  commit_phase: np.ndarray
  seconds: float = 0.0
  widths: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)

  @property
  def tpf(self) -> np.ndarray:
    """[B] answer tokens ÷ model forwards, per row."""
    lengths = np.array([len(t) for t in self.tokens], np.float64)
    return lengths / np.maximum(self.num_forwards, 1)

  @property
  def overall_tpf(self) -> float:
    """All rows' answer tokens ÷ all rows' forwards."""
    return float(sum(len(t) for t in self.tokens) / max(int(np.sum(self.num_forwards)), 1))

  def trace(self, row: int = 0) -> list[tuple[int, int, int, str]]:
    """(position, token, iteration, phase name) of every answer token of `row`."""
    return [
      (pos, tok, int(self.commit_iteration[row, pos]), PHASE_NAMES.get(int(self.commit_phase[row, pos]), "none"))
      for pos, tok in enumerate(self.tokens[row])
    ]


def bucket_length(length: int, buckets: Sequence[int] = PROMPT_BUCKETS) -> int:
  """The smallest bucket that holds `length` tokens."""
  for bucket in buckets:
    if length <= bucket:
      return bucket
  raise ValueError(f"A prompt of {length} tokens is longer than the largest bucket ({buckets[-1]}).")


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, buckets: Sequence[int] = PROMPT_BUCKETS):
  """Right-pad prompts into one bucket.

  Returns:
    tokens [B, bucket] int32 and lengths [B] int32.
  """
  lengths = np.array([len(p) for p in prompts], np.int32)
  width = bucket_length(int(lengths.max()), buckets)
  tokens = np.full((len(prompts), width), pad_id, np.int32)
  for row, prompt in enumerate(prompts):
    tokens[row, : len(prompt)] = prompt
  return tokens, lengths


def check_prompts(prompts: Sequence[Sequence[int]], config: ModelConfig, gen_length: int) -> None:
  """Reject empty prompts, ids outside the vocabulary and over-long requests."""
  if isinstance(prompts, (str, bytes)) or not len(prompts):
    raise ValueError("prompt_ids must be a non-empty list of token-id lists, e.g. [[1, 2, 3]].")
  if gen_length < 1:
    raise ValueError(f"gen_length={gen_length} must be at least 1.")
  for row, prompt in enumerate(prompts):
    if isinstance(prompt, (int, np.integer)):
      raise ValueError("prompt_ids must be a list of lists (one list per batch row), got a flat list of ints.")
    if len(prompt) == 0:
      raise ValueError(f"Prompt {row} is empty; every row needs at least one token.")
    ids = _integer_ids(row, prompt)
    bad = ids[(ids < 0) | (ids >= config.vocab_size)]
    if bad.size:
      raise ValueError(f"Prompt {row} has token id {int(bad[0])} outside the vocabulary [0, {config.vocab_size}).")
    total = len(prompt) + gen_length
    if total > config.max_position_embeddings:
      raise ValueError(
        f"Prompt {row} has {len(prompt)} tokens; with gen_length={gen_length} that is {total} "
        f"positions, more than the model's maximum {config.max_position_embeddings}. "
        f"Shorten the prompt or lower gen_length to at most {config.max_position_embeddings - len(prompt)}."
      )


def _integer_ids(row: int, prompt: Sequence[int]) -> np.ndarray:
  """Prompt `row` as a 1-D integer array; floats, bools and nested lists are refused, not rounded."""
  ids = np.asarray(prompt)
  is_bool = ids.dtype == bool or any(isinstance(t, (bool, np.bool_)) for t in prompt)
  if ids.ndim != 1 or ids.dtype.kind not in "iu" or is_bool:
    example = next((t for t in prompt if is_bool or not isinstance(t, (int, np.integer))), prompt[0])
    raise ValueError(
      f"Prompt {row} must be a flat list of integer token ids, got {example!r} (as array: dtype {ids.dtype}, "
      f"{ids.ndim}-D). Pass ints, e.g. [[1, 2, 3]]; convert a float array that holds ids with .astype(int)."
    )
  return ids


def check_special_id(name: str, value: int | None, config: ModelConfig) -> int:
  """A special token id that must exist and lie inside the vocabulary."""
  if value is None:
    raise ValueError(
      f"No {name} is known for this model: pass {name}=... explicitly "
      f"(the checkpoint's config and tokenizer did not define one)."
    )
  if not 0 <= value < config.vocab_size:
    raise ValueError(f"{name}={value} lies outside the vocabulary [0, {config.vocab_size}).")
  return int(value)


def check_threshold(name: str, value: float) -> float:
  if not 0.0 < value <= 1.0:
    raise ValueError(f"{name}={value} must lie in (0, 1].")
  return float(value)


def check_temperature(temperature: float) -> float:
  if temperature < 0:
    raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy).")
  return float(temperature)


def check_slot_layout(gen_length: int, slot_size: int, serial_blocks: int) -> None:
  """ReFusion splits G into serial blocks of whole slots: G must be a multiple of S × NB."""
  if slot_size < 1:
    raise ValueError(f"slot_size={slot_size} must be at least 1 (the paper uses 4, 8, 16 or 32).")
  if serial_blocks < 1:
    raise ValueError(f"serial_blocks={serial_blocks} must be at least 1.")
  unit = slot_size * serial_blocks
  if gen_length % unit:
    nearest = max(unit, unit * round(gen_length / unit))
    raise ValueError(
      f"gen_length={gen_length} must be a multiple of slot_size × serial_blocks = {unit}; "
      f"use gen_length={nearest}, or change slot_size / serial_blocks."
    )


def answer_tokens(out: np.ndarray, eos_id: int) -> list[list[int]]:
  """Per row of `out` [B, G] (ids by true position), the answer up to and including the first EOS."""
  rows = []
  for row in np.asarray(out).tolist():
    rows.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
  return rows


def decoder_special_tokens(
  config: ModelConfig, *, mask_id: int | None = None, eos_id: int | None = None, pad_id: int | None = None
) -> SpecialTokens:
  """The ids a decoder uses: the given ones, else the model config's (`resolve_special_tokens`).

  The pad id falls back to the EOS, then to 0: padding is never attended.
  """
  ids = resolve_special_tokens(SpecialTokens(mask=mask_id, eos=eos_id, pad=pad_id), config=config)
  return dataclasses.replace(ids, pad=0 if ids.padding is None else ids.padding)


def row_gumbel_noise(key: jax.Array, ids: jax.Array, steps: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Gumbel noise [B, *shape]: row b (prompt ids_b, at step s_b) draws from fold_in(fold_in(key, ids_b), s_b).

  Keying the noise by prompt (its index in the call's input) and step keeps
  sampled decoding reproducible however the rows of a batch advance and
  whichever row decodes a prompt.

  Args:
    ids: [B] int32 input index of each row's prompt; steps: [B] int32.
  """
  keys = jax.vmap(lambda i, step: jax.random.fold_in(jax.random.fold_in(key, i), step))(ids, steps)
  return jax.vmap(lambda k: jax.random.gumbel(k, shape, jax.numpy.float32))(keys)


def blank_after_answer(answers: list[list[int]], iteration: np.ndarray, phase: np.ndarray):
  """Commit iteration and phase [B, G] with every position past each row's answer set to none."""
  answered = np.arange(iteration.shape[1])[None, :] < np.array([len(a) for a in answers])[:, None]
  return np.where(answered, iteration, -1), np.where(answered, phase, PHASE_NONE)


# An id no token has: "no EOS known" simply never matches (the baselines run without one).
NO_TOKEN = -1


def optional_eos_id(eos_id: int | None, config: ModelConfig) -> int:
  """The checked EOS id (given, else the config's), or `NO_TOKEN` when neither names one."""
  eos_id = decoder_special_tokens(config, eos_id=eos_id).eos
  return NO_TOKEN if eos_id is None else check_special_id("eos_id", eos_id, config)


@dataclasses.dataclass(frozen=True)
class RefusionKnobs:
  """ReFusion's checked scalar knobs (docs/method.md §2), shared by the jitted decoder and its reference."""

  slot_threshold: float
  token_threshold: float
  temperature: float
  mask_id: int
  eos_id: int


def check_refusion_knobs(
  config: ModelConfig,
  gen_length: int,
  slot_size: int,
  serial_blocks: int,
  slot_threshold: float,
  token_threshold: float,
  temperature: float,
  mask_id: int | None,
  eos_id: int | None,
) -> RefusionKnobs:
  """Reject a bad slot layout or knob; the mask and EOS ids default to the config's.

  The arguments are `generate`'s keyword arguments of the same names, in its order.
  """
  check_slot_layout(gen_length, slot_size, serial_blocks)
  ids = decoder_special_tokens(config, mask_id=mask_id, eos_id=eos_id)
  return RefusionKnobs(
    slot_threshold=check_threshold("slot_threshold", slot_threshold),
    token_threshold=check_threshold("token_threshold", token_threshold),
    temperature=check_temperature(temperature),
    mask_id=check_special_id("mask_id", ids.mask, config),
    eos_id=check_special_id("eos_id", ids.eos, config),
  )


def first_argmax(x: jax.Array) -> jax.Array:
  """`jnp.argmax(x, axis=-1)` (the first maximum) as int32, in two plain reductions.

  XLA's CPU backend runs argmax's (value, index) reduction unvectorised, which
  makes it a costly op of a small model's decode step; max, then the smallest
  index holding it, gives the same index.
  """
  index = jnp.arange(x.shape[-1], dtype=jnp.int32)
  return jnp.min(jnp.where(x == jnp.max(x, axis=-1, keepdims=True), index, x.shape[-1]), axis=-1)


def pick_tokens(
  logits: jax.Array, key: jax.Array, ids: jax.Array, steps: jax.Array, temperature: jax.Array, sample: bool
) -> tuple[jax.Array, jax.Array]:
  """Greedy or Gumbel-max sampled tokens and their probabilities (the AR and MDM baselines).

  Gumbel-max on `logits + temperature * gumbel` samples from
  softmax(logits / temperature), which is what LLaDA's `add_gumbel_noise`
  computes in another form. The noise is `row_gumbel_noise` (keyed by prompt
  and step), as the ReFusion decoder's. The returned
  probability is that of the chosen token under the un-noised softmax
  (LLaDA's confidence).

  Args:
    logits: [batch, length, vocab] float32.
    ids, steps: [batch] each row's prompt index and step.
    sample: False for greedy (argmax, first maximum); a static switch.

  Returns:
    tokens [batch, length] int32 and their probabilities [batch, length] float32.
  """
  scores = logits
  if sample:
    scores = logits + temperature * row_gumbel_noise(key, ids, steps, logits.shape[1:])
  tokens = first_argmax(scores)
  return tokens, token_probs(logits, log_partition(logits), tokens)


def log_partition(logits: jax.Array) -> jax.Array:
  """log Σ_v exp(logits[..., v]): [batch, length, vocab] -> [batch, length] float32.

  With it the decoders read the probability of any token without the
  [batch, length, vocab] softmax (2.5 GB per step at vocab 151,936, batch 32,
  block 128): XLA fuses the exponentials into the reduction.
  """
  return jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)


def token_probs(logits: jax.Array, log_z: jax.Array, tokens: jax.Array) -> jax.Array:
  """Softmax probabilities of given tokens: exp(logits[b, t, tokens[b, t]] - log_z[b, t]).

  Args:
    logits: [batch, length, vocab]; log_z: [batch, length] from `log_partition`;
    tokens: [batch, length] int ids.

  Returns:
    [batch, length] float32.
  """
  picked = jnp.take_along_axis(logits, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return jnp.exp(picked.astype(jnp.float32) - log_z)


def prefill(
  model: Transformer, tokens: jax.Array, lengths: jax.Array, capacity: int
) -> tuple[jax.Array, kv_cache.KVCache]:
  """The prompt forward into a fresh cache (causal over each row's valid prompt tokens).

  Args:
    tokens: [batch, width] right-padded prompt ids; lengths: [batch] true lengths.
    capacity: cache entries per row (width + the answer's).

  Returns:
    logits [batch, width, vocab] and a `KVCache` holding the prompts at indices 0..lengths-1.
  """
  chex.assert_rank([tokens, lengths], [2, 1])
  chex.assert_type([tokens, lengths], int)
  batch, width = tokens.shape
  columns = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
  valid = columns < lengths[:, None]
  causal = jnp.tril(jnp.ones((width, width), bool))[None] & valid[:, None, :]
  logits, kv = model(tokens, columns, causal)
  cache = constrain_cache(kv_cache.KVCache.create(model.config, batch, capacity))
  return logits, kv_cache.append(cache, kv, columns, valid)


_COMPILATIONS: collections.Counter[str] = collections.Counter()


def _loop_name(loop: Callable) -> str:
  return f"{loop.__module__}.{loop.__qualname__}"


def counts_compilations(loop: Callable) -> Callable:
  """Count the traces (= compilations) of a decode loop; goes right under its `jax.jit`.

  The body of a jitted function runs only when JAX traces it, so counting
  calls of the wrapped body counts compilations, without JAX's private cache
  API. Read it with `compile_count(loop)`.
  """

  @functools.wraps(loop)
  def traced(*args, **kwargs):
    _COMPILATIONS[_loop_name(loop)] += 1
    return loop(*args, **kwargs)

  return traced


def compile_count(loop: Callable | None = None) -> int:
  """Compilations of one jitted decode loop (decorated with `counts_compilations`), or of all of them."""
  if loop is None:
    return sum(_COMPILATIONS.values())
  return _COMPILATIONS[_loop_name(loop)]


@dataclasses.dataclass(frozen=True)
class Decoder:
  """What `run_decoder` drives: a jitted decode loop with its knobs bound, and how to start its rows.

  Attributes:
    gen_length: G, answer tokens at most.
    eos_id: the checked stop id answers are cut after (`NO_TOKEN`: none).
    start: (model config, rows K, prompt width P) -> (the decoder's idle per-row
      state, its `Batch.widths` counters [len(width_names), largest width + 1]),
      all zeros (`batching.host_zeros`).
    loop: `functools.partial(jitted_loop, **knobs)`, called with (graphdef,
      params, `Batch`, max_iterations) -> `Batch`; counted by `counts_compilations`.
    width_names: the names of the `Batch.widths` rows ("forward" first).
  """

  gen_length: int
  eos_id: int
  start: Callable[[ModelConfig, int, int], tuple[object, np.ndarray]]
  loop: functools.partial
  width_names: tuple[str, ...] = ("forward",)


def _check_positive(name: str, value: int | None, none_means: str) -> None:
  if value is not None and (
    isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1
  ):
    raise ValueError(f"{name}={value!r} must be a positive integer (or None: {none_means}).")


def _round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple


def queue_size(count: int) -> int:
  """Queue entries for `count` prompts: the next power of two, so prompt counts share compilations."""
  return 1 << max(count - 1, 0).bit_length()


def start_batch(
  decoder: Decoder, config: ModelConfig, prompts: np.ndarray, lengths: np.ndarray, rows: int, queued: int
) -> Batch:
  """K = `rows` idle rows before a queue of prompts [Q, P] (lengths [Q]) of which the first `queued` are real.

  Host arrays only: starting a batch dispatches no device work.
  """
  row_state, widths = decoder.start(config, rows, prompts.shape[1])
  return Batch.create(row_state, widths, prompts, lengths, queued, decoder.gen_length)


def run_decoder(
  model: Transformer,
  prompt_ids: Sequence[Sequence[int]],
  decoder: Decoder,
  *,
  pad_id: int | None,
  mesh: jax.sharding.Mesh | None = None,
  batch_size: int | None = None,
  chunk_iterations: int | None = None,
) -> DecodeResult:
  """The host side of every jitted decoder: check, pad, start the rows, run the loop, read the answers back.

  Args:
    prompt_ids: N prompts of integer token ids, any lengths (padded into one bucket).
    pad_id: prompt padding id (never attended); defaults to the config's pad, else its EOS, else 0.
    mesh: decode on this mesh (`refusion_jax.decoding.sharding.sharded_loop`; rows and the
      queue are padded to a multiple of its batch-parallel ways); None: the default device.
    batch_size: K rows kept busy (continuous batching: a finished row takes the
      next prompt); None decodes all N prompts as one batch.
    chunk_iterations: run the compiled loop this many iterations per call
      (state in, state out), as a server would; None: one call.

  Returns:
    A `DecodeResult` in input order whose trace is blanked past each answer;
    seconds covers padding, the loop (and its compilation, when it happens)
    and the read-back.
  """
  config = model.config
  check_prompts(prompt_ids, config, decoder.gen_length)
  pad = check_special_id("pad_id", decoder_special_tokens(config, pad_id=pad_id).pad, config)
  _check_positive("batch_size", batch_size, "all prompts as one batch")
  _check_positive("chunk_iterations", chunk_iterations, "run the loop to the end in one call")
  model = inference_view(model)  # every decoder runs without remat, on weights cast once (docs/method.md §5)
  count = len(prompt_ids)
  ways = 1 if mesh is None else batch_parallel_ways(mesh)
  rows = _round_up(min(batch_size or count, count), ways)
  start = time.perf_counter()
  tokens, lengths = pad_prompts(prompt_ids, pad)
  # Queue entries past the real prompts are never admitted (copies of prompt 0, only to fill the shape).
  tokens, lengths = pad_rows(*pad_rows(tokens, lengths, queue_size(count)), ways)
  batch = start_batch(decoder, config, tokens, lengths, rows, count)
  graphdef, params = nnx.split(model)
  call = decoder.loop if mesh is None else sharded_loop(decoder.loop, mesh)
  batch = call(graphdef, params, batch, np.int32(chunk_iterations or np.iinfo(np.int32).max))
  # Without chunks the loop returns done: no read-back to check it.
  while chunk_iterations and not batch.done:
    batch = call(graphdef, params, batch, np.int32(chunk_iterations))
  out, widths = jax.device_get((batch.out, batch.widths))
  seconds = time.perf_counter() - start
  out = jax.tree.map(lambda x: np.asarray(x)[:count], out)
  answers = answer_tokens(out.answer, decoder.eos_id)
  iteration, phase = blank_after_answer(answers, out.commit_iteration, out.commit_phase)
  return DecodeResult(
    tokens=answers,
    num_forwards=out.num_forwards,
    steps=out.steps,
    commit_iteration=iteration,
    commit_phase=phase,
    seconds=seconds,
    widths={name: {w: int(c) for w, c in enumerate(counts) if c} for name, counts in zip(decoder.width_names, widths)},
  )
