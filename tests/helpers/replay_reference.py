"""An eager reference of the speculative ReFusion and AR policies' log-probabilities, written from docs/rl.md.

Nothing is shared with `refusion_jax.rl.replay` but the model forward: each cycle of a ReFusion trajectory is
replayed as the decoder ran it, one PLAN forward of the block's undecided slots' masks against a KV cache of
what was committed before the cycle, then one forward per committed slot against that same cache (the slot's
tokens alone, as its CHECK rows saw them), whose keys and values then join the cache. The sampling filters are
a float64 NumPy transcription of docs/sampling.md. Plain Python loops; fine for tiny models.

Also: random trajectories with the structure of a speculative ReFusion rollout (`random_refusion_trajectory`),
for testing the replay without a decoder.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx

from refusion_jax.model.cache import KVCache
from refusion_jax.model.transformer import Transformer
from refusion_jax.rl import replay


@dataclasses.dataclass(frozen=True)
class Layout:
  """A method's static facts, as `trajectory_logprobs` reads them off the method value."""

  name: str
  gen_length: int
  slot_size: int = 1
  serial_blocks: int = 1
  acceptance: str = "speculative"


def policy_distribution(logits: np.ndarray, temperature: float, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
  """[vocab] float64 log-probabilities of softmax(filtered(logits / T)) (-inf: filtered out); T = 0: the model's
  own log-softmax. Filters in vLLM's order: top_k, then top_p on the renormalised rest, then min_p."""
  z = np.asarray(logits, np.float64)
  if temperature > 0:
    z = z / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.ones_like(z, bool)
    if top_k > 0:
      keep[order[top_k:]] = False
    p = np.exp(z - z.max()) * keep
    p /= p.sum()
    if top_p < 1:
      mass_before = np.cumsum(p[order]) - p[order]
      keep[order[mass_before >= top_p]] = False
    if min_p > 0:
      keep &= np.exp(z - z.max()) >= min_p
    z = np.where(keep, z, -np.inf)
  return z - z.max() - np.log(np.exp(z - z.max()).sum())


def policy_logprob(logits: np.ndarray, token: int, temperature: float, top_k=0, top_p=1.0, min_p=0.0) -> float:
  """log-probability of `token` under `policy_distribution`."""
  return float(policy_distribution(logits, temperature, top_k, top_p, min_p)[token])


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, tokens, positions, cache):
  logits, kv = nnx.merge(graphdef, params)(tokens, positions, cache=cache)
  return logits, kv


class _Cache:
  """Committed tokens' keys and values in commit order; forwards of one row of a fixed width against them."""

  def __init__(self, model: Transformer, capacity: int, width: int):
    self.graphdef, self.params = nnx.split(model)
    c = model.config
    self.k = np.zeros((c.num_layers, 1, capacity, c.num_kv_heads, c.head_dim), np.float32)
    self.v = np.zeros_like(self.k)
    self.positions = np.zeros((1, capacity), np.int32)
    self.length = 0
    self.width = width

  def forward(self, tokens: list[int], positions: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Logits [n, vocab] of `tokens` (causal among themselves, seeing every stored entry) and their keys and
    values [layers, 1, n, kv_heads, head_dim]."""
    n = len(tokens)
    fed, at = np.zeros((1, self.width), np.int32), np.zeros((1, self.width), np.int32)
    fed[0, :n], at[0, :n] = tokens, positions
    capacity = self.k.shape[2]
    cache = KVCache(
      k=self.k,
      v=self.v,
      positions=self.positions,
      valid=np.arange(capacity)[None] < self.length,
      length=np.array([self.length], np.int32),
    )
    logits, kv = jax.device_get(_forward(self.graphdef, self.params, fed, at, cache))
    return logits[0, :n], kv.k[:, :, :n], kv.v[:, :, :n]

  def extend(self, k: np.ndarray, v: np.ndarray, positions: list[int]) -> None:
    n = len(positions)
    self.k[:, :, self.length : self.length + n] = k
    self.v[:, :, self.length : self.length + n] = v
    self.positions[0, self.length : self.length + n] = positions
    self.length += n


def refusion_logprobs(
  model: Transformer,
  prompt: list[int],
  tokens: np.ndarray,
  iteration: np.ndarray,
  *,
  slot_size: int,
  serial_blocks: int,
  mask_id: int,
  eos_id: int,
  sampling: dict,
) -> np.ndarray:
  """[G] float64 log-probabilities of one speculative ReFusion trajectory (NaN where nothing was committed).

  Args:
    tokens, iteration: [G] the rollout (-1 where none). sampling: temperature, top_k, top_p, min_p.
  """
  G, S = len(tokens), slot_size
  T = G // serial_blocks
  out = np.full(G, np.nan)
  P = len(prompt)
  cache = _Cache(model, P + G, max(T, P))
  _, k, v = cache.forward(prompt, list(range(P)))
  cache.extend(k, v, list(range(P)))
  block, undecided = -1, []
  for cycle in range(int(iteration.max(initial=-1)) + 1):
    committed = [s for s in range(G // S) if iteration[s * S] == cycle]
    assert committed, f"cycle {cycle} committed nothing"
    if committed[0] * S // T != block:
      block = committed[0] * S // T
      undecided = list(range(block * T // S, (block + 1) * T // S))
    # PLAN: masks at every token of every undecided slot, causal among them.
    plan_positions = [s * S + o for s in undecided for o in range(S)]
    logits, _, _ = cache.forward([mask_id] * len(plan_positions), [P + p for p in plan_positions])
    for s in committed:
      out[s * S] = policy_logprob(logits[plan_positions.index(s * S)], tokens[s * S], **sampling)
    # Each committed slot alone against the cache of earlier cycles.
    new = []
    for s in committed:
      length = int(np.sum(tokens[s * S : (s + 1) * S] >= 0))
      slot_tokens = [int(t) for t in tokens[s * S : s * S + length]]
      positions = [P + s * S + o for o in range(length)]
      logits, k, v = cache.forward(slot_tokens, positions)
      for o in range(1, length):
        out[s * S + o] = policy_logprob(logits[o - 1], slot_tokens[o], **sampling)
      new.append((k, v, positions))
    for k, v, positions in new:
      cache.extend(k, v, positions)
    # Committed slots leave the pool; an EOS drops the undecided slots after its slot.
    eos_slots = [s for s in committed if eos_id in tokens[s * S : (s + 1) * S]]
    undecided = [s for s in undecided if s not in committed and not (eos_slots and s > eos_slots[0])]
  return out


def ar_logprobs(model: Transformer, prompt: list[int], tokens: np.ndarray, sampling: dict) -> np.ndarray:
  """[G] float64 log-probabilities of one AR answer (NaN where nothing was committed): one causal forward."""
  answer = [int(t) for t in tokens if t >= 0]
  sequence = list(prompt) + answer
  logits, _, _ = _Cache(model, 1, 32).forward(sequence, list(range(len(sequence))))
  out = np.full(len(tokens), np.nan)
  for t, token in enumerate(answer):
    out[t] = policy_logprob(logits[len(prompt) + t - 1], token, **sampling)
  return out


def random_refusion_trajectory(
  rng: np.random.Generator, *, gen_length: int, slot_size: int, serial_blocks: int, vocab_size: int, eos_id: int
) -> tuple[np.ndarray, np.ndarray]:
  """tokens, iteration [G] of a random trajectory with the structure of a speculative ReFusion rollout: each
  cycle commits a random non-empty set of its block's undecided slots; the first EOS among them ends its slot,
  drops the chosen slots after it and the block's undecided slots after it, and ends the answer with its block.
  """
  G, S = gen_length, slot_size
  T = G // serial_blocks
  tokens, iteration = np.full(G, -1), np.full(G, -1)
  cycle = 0
  for block in range(serial_blocks):
    undecided = list(range(block * T // S, (block + 1) * T // S))
    eos_seen = False
    while undecided:
      chosen = sorted(rng.choice(undecided, size=rng.integers(1, len(undecided) + 1), replace=False).tolist())
      draws = rng.integers(0, vocab_size, size=(len(chosen), S))
      draws[rng.random(draws.shape) < 0.12] = eos_id
      eos_slot = None
      for s, slot_tokens in zip(chosen, draws):
        if eos_slot is not None:
          break
        for o, token in enumerate(slot_tokens):
          tokens[s * S + o], iteration[s * S + o] = token, cycle
          if token == eos_id:
            eos_slot = s
            break
      committed = [s for s in chosen if eos_slot is None or s <= eos_slot]
      undecided = [s for s in undecided if s not in committed and not (eos_slot is not None and s > eos_slot)]
      eos_seen |= eos_slot is not None
      cycle += 1
    if eos_seen:
      break
  return tokens, iteration


def random_rollouts(
  rng: np.random.Generator, method, rows: int, *, vocab_size: int, eos_id: int
) -> tuple[list[list[int]], replay.Trajectory]:
  """Random prompts (1 to 11 tokens) and random rollouts of `method` (AR answers cut after their first EOS, or
  `random_refusion_trajectory`s)."""
  prompts = [rng.integers(0, vocab_size - 1, int(n)).tolist() for n in rng.integers(1, 12, rows)]
  if method.name == "ar":
    tokens = rng.integers(0, vocab_size, (rows, method.gen_length))
    for row in tokens:
      eos = np.flatnonzero(row == eos_id)
      if len(eos):
        row[eos[0] + 1 :] = -1
    return prompts, replay.Trajectory(tokens, np.where(tokens >= 0, np.arange(method.gen_length), -1))
  trajectories = [
    random_refusion_trajectory(
      rng,
      gen_length=method.gen_length,
      slot_size=method.slot_size,
      serial_blocks=method.serial_blocks,
      vocab_size=vocab_size,
      eos_id=eos_id,
    )
    for _ in range(rows)
  ]
  return prompts, replay.Trajectory(*(np.stack(x) for x in zip(*trajectories)))
