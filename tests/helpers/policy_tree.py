"""Every trajectory a policy can produce on one prompt, with its probability, by walking the decoding process.

For a model whose vocabulary is tiny (V = 8) and a short answer (G = 4), the process of speculative ReFusion
(docs/method.md §6) is a small tree: each cycle, a PLAN forward of the block's undecided slots gives each slot's
confidence (the largest probability at its first token, un-tempered), which fixes the chosen slots; each chosen
slot's first token then ranges over the plan distribution at its mask, each later token over the AR
distribution given the slot's earlier tokens (its own forward against the cache of earlier cycles). An EOS ends
its slot, drops the chosen and undecided slots after it, and ends the answer with its block. The walk uses the
eager per-cycle forwards of `replay_reference` and float64 distributions; nothing of the replay or the decoder.

AR's tree is the plain one: one batched causal forward per answer length.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np
from flax import nnx

from helpers.replay_reference import _Cache, _forward, policy_distribution
from refusion_jax.model.transformer import Transformer


@dataclasses.dataclass
class Leaf:
  """One trajectory: tokens and iteration [G] (-1 where none), and its log-probability (float64)."""

  tokens: np.ndarray
  iteration: np.ndarray
  logprob: float


def _copy(cache: _Cache) -> _Cache:
  new = object.__new__(_Cache)
  new.__dict__.update(cache.__dict__)
  new.k, new.v, new.positions = cache.k.copy(), cache.v.copy(), cache.positions.copy()
  return new


def refusion_leaves(
  model: Transformer,
  prompt: list[int],
  *,
  gen_length: int,
  slot_size: int,
  serial_blocks: int,
  slot_threshold: float,
  mask_id: int,
  eos_id: int,
  sampling: dict,
) -> list[Leaf]:
  """Every trajectory of speculative ReFusion on `prompt` with its log-probability."""
  G, S, P = gen_length, slot_size, len(prompt)
  T = G // serial_blocks
  root = _Cache(model, P + G, max(T, P))
  _, k, v = root.forward(prompt, list(range(P)))
  root.extend(k, v, list(range(P)))
  leaves: list[Leaf] = []

  def slot_outcomes(cache: _Cache, slot: int, first: np.ndarray):
    """(tokens, log-probability) of every way slot `slot` can end, given its first token's log-distribution."""
    stack = [([int(t)], float(first[t])) for t in np.flatnonzero(np.isfinite(first))]
    while stack:
      tokens, logprob = stack.pop()
      if tokens[-1] == eos_id or len(tokens) == S:
        yield tokens, logprob
        continue
      logits, _, _ = cache.forward(tokens, [P + slot * S + o for o in range(len(tokens))])
      following = policy_distribution(logits[-1], **sampling)
      stack.extend((tokens + [int(t)], logprob + float(following[t])) for t in np.flatnonzero(np.isfinite(following)))

  def visit(cache, tokens, iteration, cycle, block, undecided, eos_seen, logprob):
    if not undecided:
      if eos_seen or block == serial_blocks - 1:
        leaves.append(Leaf(tokens.copy(), iteration.copy(), logprob))
        return
      block += 1
      undecided = list(range(block * T // S, (block + 1) * T // S))
    plan_positions = [s * S + o for s in undecided for o in range(S)]
    logits, _, _ = cache.forward([mask_id] * len(plan_positions), [P + p for p in plan_positions])
    at_first = {s: logits[plan_positions.index(s * S)] for s in undecided}
    confidence = {s: np.exp(policy_distribution(at_first[s], temperature=0.0).max()) for s in undecided}
    chosen = [s for s in undecided if confidence[s] > slot_threshold]
    chosen = chosen or [max(undecided, key=lambda s: (confidence[s], -s))]
    outcomes = [list(slot_outcomes(cache, s, policy_distribution(at_first[s], **sampling))) for s in chosen]
    seen = set()
    for combo in itertools.product(*outcomes):
      # Slots after the first one ending in EOS are dropped: their draws do not matter (one branch each).
      cut = next((i for i, (slot_tokens, _) in enumerate(combo) if eos_id in slot_tokens), len(combo) - 1)
      kept = combo[: cut + 1]
      key = tuple(tuple(t) for t, _ in kept)
      if key in seen:
        continue
      seen.add(key)
      new_tokens, new_iteration = tokens.copy(), iteration.copy()
      committed = chosen[: cut + 1]
      for s, (slot_tokens, _) in zip(committed, kept):
        new_tokens[s * S : s * S + len(slot_tokens)] = slot_tokens
        new_iteration[s * S : s * S + len(slot_tokens)] = cycle
      has_eos = any(eos_id in t for t, _ in kept)
      rest = [s for s in undecided if s not in committed and not (has_eos and s > committed[-1])]
      child_logprob = logprob + sum(lp for _, lp in kept)
      if not rest and (has_eos or eos_seen or block == serial_blocks - 1):
        leaves.append(Leaf(new_tokens, new_iteration, child_logprob))
        continue
      child = _copy(cache)
      kvs = []
      for s, (slot_tokens, _) in zip(committed, kept):
        positions = [P + s * S + o for o in range(len(slot_tokens))]
        _, k, v = cache.forward(slot_tokens, positions)
        kvs.append((k, v, positions))
      for k, v, positions in kvs:
        child.extend(k, v, positions)
      visit(child, new_tokens, new_iteration, cycle + 1, block, rest, eos_seen or has_eos, child_logprob)

  first_block = list(range(T // S))
  visit(root, np.full(G, -1), np.full(G, -1), 0, 0, first_block, False, 0.0)
  return leaves


def ar_leaves(model: Transformer, prompt: list[int], *, gen_length: int, eos_id: int, sampling: dict) -> list[Leaf]:
  """Every AR answer on `prompt` with its log-probability: one batched causal forward per answer length."""
  graphdef, params = nnx.split(model)
  open_prefixes = [([], 0.0)]
  leaves: list[Leaf] = []
  for step in range(gen_length):
    # One shape for every length: the forward compiles once.
    fed = np.zeros((model.config.vocab_size ** (gen_length - 1), len(prompt) + gen_length), np.int32)
    for row, (tokens, _) in enumerate(open_prefixes):
      fed[row, : len(prompt) + step] = prompt + tokens
    positions = np.broadcast_to(np.arange(fed.shape[1], dtype=np.int32), fed.shape)
    logits, _ = jax.device_get(_forward(graphdef, params, fed, positions, None))
    grown = []
    for (tokens, logprob), row in zip(open_prefixes, logits[:, len(prompt) + step - 1]):
      following = policy_distribution(row, **sampling)
      for t in np.flatnonzero(np.isfinite(following)):
        child = (tokens + [int(t)], logprob + float(following[t]))
        if t == eos_id or step + 1 == gen_length:
          grid = np.full(gen_length, -1)
          grid[: len(child[0])] = child[0]
          leaves.append(Leaf(grid, np.where(grid >= 0, np.arange(gen_length), -1), child[1]))
        else:
          grown.append(child)
    open_prefixes = grown
  return leaves
