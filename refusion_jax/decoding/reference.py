"""An eager, batch-1 ReFusion decoder written straight from docs/method.md §2.

It exists to be read next to the paper and to check `refusion_jax.decoding.refusion`
against: plain Python loops, dynamic shapes, and nothing shared with the
jitted decoder but the model forward (itself jitted, on shapes padded to
powers of two, only so that hundreds of test cases run in seconds). It is
slow; do not serve with it.

The cache is kept as explicit per-token keys and values in commit order. Each
committed token keeps the KV of the pass that committed it: the global
verification pass for a whole-slot prefix commit (step 2), the slot's last
infill verification pass (which saw only the cache and that slot) for an
infill commit (step 3). It is never recomputed in position order.
"""

from __future__ import annotations

import collections
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from refusion_jax.decoding.checks import (
  check_prompts,
  check_slot_layout,
  check_special_id,
  check_temperature,
  check_threshold,
)
from refusion_jax.decoding.result import PHASE_INFILL, PHASE_NONE, PHASE_VERIFY, DecodeResult
from refusion_jax.model.cache import KVCache
from refusion_jax.model.transformer import Transformer, inference_view


def _bucket(n: int, least: int = 1) -> int:
  """The smallest power of two >= max(n, least)."""
  return max(least, 1 << max(n - 1, 0).bit_length())


@functools.partial(jax.jit, static_argnums=0)
def _padded_forward(graphdef, params, tokens, positions, cache):
  logits, kv = nnx.merge(graphdef, params)(tokens, positions, cache=cache)
  return logits, jax.nn.softmax(logits, axis=-1), kv


class _Storage:
  """The committed tokens' keys and values in commit order, and the forward against them.

  k, v: numpy [layers, 1, length, kv_heads, head_dim]; positions: length true positions.
  """

  def __init__(self, model: Transformer):
    self.graphdef, self.params = nnx.split(model)
    c = model.config
    self.k = np.zeros((c.num_layers, 1, 0, c.num_kv_heads, c.head_dim), np.float32)
    self.v = self.k
    self.positions: list[int] = []

  def forward(self, tokens: list[list[int]], positions: list[list[int]]):
    """Forward R rows of T tokens; each row sees every stored entry and its own earlier tokens.

    Only shapes are padded (to powers of two, at least 16 query tokens and 64
    stored entries) so that the forward compiles a few times rather than once
    per step: stored entries past the length are invalid, extra query tokens
    come after the real ones (unseen under the causal mask) and extra rows
    are dropped.

    Returns:
      logits [R, T, vocab] and softmax probabilities [R, T, vocab] (numpy
      float32), and the rows' keys and values, each numpy [layers, R, T, kv_heads, head_dim].
    """
    rows, width, length = len(tokens), len(tokens[0]), len(self.positions)
    padded_rows, padded_width, capacity = _bucket(rows), _bucket(width, 16), _bucket(length, 64)
    query = np.zeros((padded_rows, padded_width), np.int32)
    query_positions = np.zeros((padded_rows, padded_width), np.int32)
    query[:rows, :width], query_positions[:rows, :width] = tokens, positions
    layers, _, _, kv_heads, head_dim = self.k.shape
    k = np.zeros((layers, padded_rows, capacity, kv_heads, head_dim), self.k.dtype)
    v = np.zeros_like(k)
    k[:, :, :length], v[:, :, :length] = self.k, self.v
    stored_positions = np.zeros((padded_rows, capacity), np.int32)
    stored_positions[:, :length] = self.positions
    cache = KVCache(
      k=k,
      v=v,
      positions=stored_positions,
      valid=np.broadcast_to(np.arange(capacity) < length, (padded_rows, capacity)),
      length=np.full((padded_rows,), length, np.int32),
    )
    outputs = _padded_forward(self.graphdef, self.params, query, query_positions, cache)
    logits, probs, kv = jax.device_get(outputs)
    return logits[:rows, :width], probs[:rows, :width], kv.k[:, :rows, :width], kv.v[:, :rows, :width]

  def extend(self, k: np.ndarray, v: np.ndarray, positions: list[int]) -> None:
    """Append entries ([layers, 1, n, kv_heads, head_dim]) after the stored ones."""
    self.k = np.concatenate([self.k, k], axis=2)
    self.v = np.concatenate([self.v, v], axis=2)
    self.positions = self.positions + list(positions)


def _leading_passes(passes: list[bool]) -> int:
  """Length of the run of True at the start (a cumulative product)."""
  count = 0
  while count < len(passes) and passes[count]:
    count += 1
  return count


def decode_reference(
  model: Transformer,
  prompt_ids: list[int],
  *,
  gen_length: int,
  slot_size: int,
  serial_blocks: int,
  slot_threshold: float,
  token_threshold: float,
  mask_id: int,
  eos_id: int,
  temperature: float = 0.0,
  seed: int = 0,
  stats: collections.Counter | None = None,
) -> DecodeResult:
  """Plan-and-infill decoding of one prompt, eagerly.

  Temperature > 0 adds Gumbel noise to the plan logits only, drawn as
  `gumbel(fold_in(fold_in(key(seed), 0), plan_step), [block_length, vocab])`
  and read at the undecided slots' block offsets, which is the noise row 0 of
  `refusion_jax.decode(..., ReFusion(...))` uses. Infill drafts are always argmax.

  Args:
    prompt_ids: one prompt of token ids.
    stats: optional counter, incremented with how often each branch of the
      method ran (for branch-coverage tests).

  Returns:
    A batch-1 `DecodeResult`; commit_iteration is the plan step (0-based) whose
    cycle committed each answer position.
  """
  model = inference_view(model)
  config = model.config
  check_prompts([prompt_ids], config, gen_length)
  check_slot_layout(gen_length, slot_size, serial_blocks)
  slot_threshold = np.float32(check_threshold("slot_threshold", slot_threshold))
  token_threshold = np.float32(check_threshold("token_threshold", token_threshold))
  temperature = np.float32(check_temperature(temperature))
  mask_id, eos_id = check_special_id("mask_id", mask_id, config), check_special_id("eos_id", eos_id, config)
  counts = collections.Counter()
  start_time = time.perf_counter()

  S = slot_size
  block_length = gen_length // serial_blocks
  prompt_length = len(prompt_ids)
  storage = _Storage(model)
  _, _, prompt_k, prompt_v = storage.forward([list(prompt_ids)], [list(range(prompt_length))])
  storage.extend(prompt_k, prompt_v, list(range(prompt_length)))
  # Answer offset -> (token, plan step, phase) of every committed position.
  committed: dict[int, tuple[int, int, int]] = {}
  forwards, steps = 1, 0  # the prompt prefill above is the first forward
  eos_seen = False

  def commit(tokens, offsets, k, v, step, phase):
    storage.extend(k, v, [prompt_length + o for o in offsets])
    for token, offset in zip(tokens, offsets):
      committed[offset] = (token, step, phase)

  for block in range(serial_blocks):
    if eos_seen:
      break
    counts["later_blocks"] += block > 0
    block_start = block * block_length
    # Undecided slots, named by the answer offset of their first token, in original order.
    undecided = list(range(block_start, block_start + block_length, S))
    while undecided:
      step = steps
      steps += 1
      if eos_seen:
        counts["plans_after_eos"] += 1

      # 1. Plan: every undecided slot as mask tokens, causal in original order.
      offsets = [slot + j for slot in undecided for j in range(S)]
      positions = [[prompt_length + o for o in offsets]]
      logits, probs, _, _ = storage.forward([[mask_id] * len(offsets)], positions)
      forwards += 1
      scores = logits[0]
      if temperature > 0:
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 0), step)
        noise = np.asarray(jax.random.gumbel(key, (block_length, config.vocab_size), jnp.float32))
        scores = scores + temperature * noise[[o - block_start for o in offsets]]
      x0 = np.argmax(scores, axis=-1)
      x0_prob = probs[0, np.arange(len(offsets)), x0]
      confidence = x0_prob[::S]
      chosen = [slot for slot, c in zip(undecided, confidence) if c > slot_threshold]
      if not chosen:
        chosen = [undecided[int(np.argmax(confidence))]]
        counts["plans_forced_choice"] += 1
      if len(chosen) > 1:
        counts["plans_several_slots"] += 1
      drafts = {slot: [int(t) for t in x0[undecided.index(slot) * S :][:S]] for slot in chosen}

      # 2. Global verification: the chosen drafts concatenated, causal over that order.
      flat = [t for slot in chosen for t in drafts[slot]]
      flat_offsets = [slot + j for slot in chosen for j in range(S)]
      _, probs, k, v = storage.forward([flat], [[prompt_length + o for o in flat_offsets]])
      forwards += 1
      passes = [i % S == 0 or probs[0, i - 1, flat[i]] > token_threshold for i in range(len(flat))]
      prefix = _leading_passes(passes)
      eos_in_prefix = [i for i in range(prefix) if flat[i] == eos_id]
      if eos_in_prefix or prefix >= S:
        cut = eos_in_prefix[0] + 1 if eos_in_prefix else (prefix // S) * S
        counts["prefix_commits_eos" if eos_in_prefix else "prefix_commits"] += 1
        commit(flat[:cut], flat_offsets[:cut], k[:, :, :cut], v[:, :, :cut], step, PHASE_VERIFY)
        done_slots = chosen[: -(-cut // S)]
        undecided = [slot for slot in undecided if slot not in done_slots]
        if eos_in_prefix:
          eos_seen = True
          undecided = [slot for slot in undecided if slot < done_slots[-1]]
        continue

      # 3. Parallel infill: each chosen slot sees only the storage and itself.
      counts["infills"] += 1
      accepted = [_leading_passes(passes[i * S : (i + 1) * S]) for i in range(len(chosen))]
      counts["infill_slots_partly_accepted"] += sum(1 < a < S for a in accepted)
      counts["infill_slots_fully_accepted"] += sum(a == S for a in accepted)
      tokens = [list(drafts[slot]) for slot in chosen]
      eos_slot = None
      rounds = 0
      while True:
        rounds += 1
        positions = [[prompt_length + slot + j for j in range(S)] for slot in chosen]
        # a. Draft: unaccepted tokens as masks; a masked token predicts itself.
        fed = [[t if j < a else mask_id for j, t in enumerate(row)] for row, a in zip(tokens, accepted)]
        logits, _, _, _ = storage.forward(fed, positions)
        forwards += 1
        for i, a in enumerate(accepted):
          tokens[i][a:] = [int(t) for t in np.argmax(logits[i, a:], axis=-1)]
        # b. Verify: the first unaccepted token is forced, later ones need their AR probability.
        _, probs, k, v = storage.forward(tokens, positions)
        forwards += 1
        for i, a in enumerate(accepted):
          if a < S:
            later = [probs[i, j - 1, tokens[i][j]] > token_threshold for j in range(a + 1, S)]
            accepted[i] = a + 1 + _leading_passes(later)
        # c. The first slot holding an accepted EOS is finished; chosen slots after it are dropped.
        with_eos = [i for i, a in enumerate(accepted) if eos_id in tokens[i][:a]]
        if with_eos:
          eos_slot = with_eos[0]
          counts["infill_slots_dropped"] += len(chosen) - eos_slot - 1
          chosen, tokens, accepted = chosen[: eos_slot + 1], tokens[: eos_slot + 1], accepted[: eos_slot + 1]
          accepted[eos_slot] = S
        if all(a == S for a in accepted):
          break
      counts["infill_rounds"] += rounds
      counts["infills_several_rounds"] += rounds > 1

      flat = [t for row in tokens for t in row]
      cut = flat.index(eos_id) + 1 if eos_slot is not None else len(flat)
      flat_offsets = [slot + j for slot in chosen for j in range(S)]
      # Entries of the last verify pass, slot after slot: [layers, 1, n * S, kv_heads, head_dim].
      k, v = (x[:, : len(chosen)].reshape(x.shape[0], 1, len(chosen) * S, *x.shape[3:]) for x in (k, v))
      commit(flat[:cut], flat_offsets[:cut], k[:, :, :cut], v[:, :, :cut], step, PHASE_INFILL)
      undecided = [slot for slot in undecided if slot not in chosen]
      if eos_slot is not None:
        counts["infill_eos"] += 1
        eos_seen = True
        undecided = [slot for slot in undecided if slot < chosen[eos_slot]]

  # Read the answer back by true position, up to and including the first EOS.
  answer = []
  for offset in range(gen_length):
    answer.append(committed[offset][0])
    if answer[-1] == eos_id:
      break
  iteration = np.full((1, gen_length), -1, np.int32)
  phase = np.full((1, gen_length), PHASE_NONE, np.int32)
  for offset in range(len(answer)):
    _, iteration[0, offset], phase[0, offset] = committed[offset]
  if stats is not None:
    stats.update(counts)
  return DecodeResult(
    tokens=[answer],
    num_forwards=np.array([forwards], np.int32),
    steps=np.array([steps], np.int32),
    commit_iteration=iteration,
    commit_phase=phase,
    seconds=time.perf_counter() - start_time,
  )
