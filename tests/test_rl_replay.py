"""The replay of a rollout's log-probabilities (refusion_jax.rl.replay, docs/rl.md §2) against an eager reference
that runs each cycle's forwards with a KV cache, and its promises: no [rows, length, vocab] logits, gradients."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import replay_reference
from helpers.decode_cases import random_weights

from refusion_jax.decoding.prompts import pad_prompts
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import init_model
from refusion_jax.parallel.compiled import sub_jaxprs
from refusion_jax.rl import replay

VOCAB, MASK, EOS = 24, 23, 5
STATIC = ("method", "tail_length", "chunk", "mask_id", "eos_id")


@dataclasses.dataclass(frozen=True)
class Layout:
  """A method's static facts, as `trajectory_logprobs` reads them off the method value."""

  name: str
  gen_length: int
  slot_size: int = 1
  serial_blocks: int = 1
  acceptance: str = "speculative"


def random_model(seed: int):
  model = init_model(tiny(vocab_size=VOCAB))
  return random_weights(model, seed=seed, weight_std=0.3, head_std=1.0)


def random_rollouts(rng, method: Layout, rows: int) -> tuple[list[list[int]], replay.Trajectory]:
  prompts = [rng.integers(0, VOCAB - 1, int(n)).tolist() for n in rng.integers(1, 12, rows)]
  if method.name == "ar":
    tokens = rng.integers(0, VOCAB, (rows, method.gen_length))
    for row in tokens:
      eos = np.flatnonzero(row == EOS)
      if len(eos):
        row[eos[0] + 1 :] = -1
    return prompts, replay.Trajectory(tokens, np.where(tokens >= 0, np.arange(method.gen_length), -1))
  trajectories = [
    replay_reference.random_refusion_trajectory(
      rng,
      gen_length=method.gen_length,
      slot_size=method.slot_size,
      serial_blocks=method.serial_blocks,
      vocab_size=VOCAB,
      eos_id=EOS,
    )
    for _ in range(rows)
  ]
  return prompts, replay.Trajectory(*(np.stack(x) for x in zip(*trajectories)))


def reference(model, prompts, rollout, method: Layout, sampling: dict) -> np.ndarray:
  if method.name == "ar":
    rows = [replay_reference.ar_logprobs(model, p, t, sampling) for p, t in zip(prompts, rollout.tokens)]
  else:
    rows = [
      replay_reference.refusion_logprobs(
        model,
        p,
        t,
        i,
        slot_size=method.slot_size,
        serial_blocks=method.serial_blocks,
        mask_id=MASK,
        eos_id=EOS,
        sampling=sampling,
      )
      for p, t, i in zip(prompts, rollout.tokens, rollout.iteration)
    ]
  return np.stack(rows)


replay_jit = nnx.jit(replay.trajectory_logprobs, static_argnames=STATIC)

METHODS = [
  Layout("refusion", gen_length=8, slot_size=2, serial_blocks=1),
  Layout("refusion", gen_length=12, slot_size=2, serial_blocks=2),
  Layout("ar", gen_length=8),
]
SAMPLINGS = [
  dict(temperature=0.0),
  dict(temperature=0.8),
  dict(temperature=1.3, top_k=7, top_p=0.9, min_p=0.02),
]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: f"{m.name}-G{m.gen_length}-S{m.slot_size}x{m.serial_blocks}")
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_replay_equals_the_eager_reference(method, sampling):
  rng = np.random.default_rng(hash((method, tuple(sampling.items()))) % (1 << 32))
  model = random_model(int(rng.integers(1 << 30)))
  prompts, rollout = random_rollouts(rng, method, rows=6)
  ids, lengths = pad_prompts(prompts, pad_id=0)
  full = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0) | sampling
  got = replay_jit(model, ids, lengths, rollout, method, mask_id=MASK, eos_id=EOS, chunk=5, **full)
  want = reference(model, prompts, rollout, method, full)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)
  assert np.isnan(want).any() and np.isfinite(want).any()  # the case holds EOS-cut answers


def test_a_first_token_past_the_tail_budget_is_not_scored():
  rng = np.random.default_rng(7)
  method = Layout("refusion", gen_length=8, slot_size=2)
  model = random_model(3)
  prompts, rollout = random_rollouts(rng, method, rows=8)
  ids, lengths = pad_prompts(prompts, pad_id=0)
  needed = replay.tail_length_needed(rollout, method, eos_id=EOS)
  assert 0 < needed <= replay.max_tail_length(method)
  kwargs = dict(mask_id=MASK, eos_id=EOS, temperature=0.7)
  full = replay_jit(model, ids, lengths, rollout, method, **kwargs)
  exact = replay_jit(model, ids, lengths, rollout, method, tail_length=needed, **kwargs)
  short = replay_jit(model, ids, lengths, rollout, method, tail_length=needed - 1, **kwargs)
  np.testing.assert_allclose(exact, full, atol=1e-5)
  lost = np.isnan(short) & ~np.isnan(full)
  assert lost.any() and (np.arange(8)[np.nonzero(lost)[1]] % 2 == 0).all()  # only first tokens
  np.testing.assert_allclose(np.where(lost, 0, short), np.where(lost, 0, full), atol=1e-5)


def _largest_vocab_array(jaxpr, rows: int, vocab: int) -> int:
  """Elements of the largest value with a [rows, ..., vocab] shape anywhere in a jaxpr."""
  largest = 0
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      shape = getattr(var.aval, "shape", ())
      if len(shape) >= 2 and shape[0] == rows and shape[-1] == vocab:
        largest = max(largest, int(np.prod(shape)))
    for sub in sub_jaxprs(eqn.params.values()):
      largest = max(largest, _largest_vocab_array(sub, rows, vocab))
  return largest


def test_gradients_hold_one_chunk_of_logits_and_equal_the_dense_ones():
  rng = np.random.default_rng(11)
  method = Layout("refusion", gen_length=8, slot_size=2)
  model = random_model(5)
  rows = 4
  prompts, rollout = random_rollouts(rng, method, rows=rows)
  ids, lengths = pad_prompts(prompts, pad_id=0)
  graphdef, params = nnx.split(model)

  def total(params, chunk):
    logprobs = replay.trajectory_logprobs(
      nnx.merge(graphdef, params), ids, lengths, rollout, method, temperature=0.9, mask_id=MASK, eos_id=EOS, chunk=chunk
    )
    return jnp.sum(jnp.where(jnp.isnan(logprobs), 0.0, logprobs))

  chunked = jax.make_jaxpr(jax.grad(total), static_argnums=1)(params, 3).jaxpr
  assert _largest_vocab_array(chunked, rows, VOCAB) == rows * 3 * VOCAB
  grad = jax.jit(jax.value_and_grad(total), static_argnums=1)
  (dense_value, dense_grads), (value, grads) = grad(params, 0), grad(params, 3)
  np.testing.assert_allclose(value, dense_value, rtol=1e-6)
  for chunked_grad, dense_grad in zip(jax.tree.leaves(grads), jax.tree.leaves(dense_grads)):
    assert np.isfinite(chunked_grad).all()
    np.testing.assert_allclose(chunked_grad, dense_grad, rtol=1e-4, atol=1e-6)


def test_threshold_rollouts_and_mdm_are_refused_by_name():
  model = random_model(0)
  ids, lengths = pad_prompts([[1, 2]], pad_id=0)
  rollout = replay.Trajectory(np.zeros((1, 8), np.int32), np.zeros((1, 8), np.int32))
  with pytest.raises(ValueError, match="threshold rule"):
    replay.trajectory_logprobs(
      model, ids, lengths, rollout, Layout("refusion", 8, 2, acceptance="threshold"), temperature=0.0
    )
  with pytest.raises(ValueError, match="MDM"):
    replay.trajectory_logprobs(model, ids, lengths, rollout, Layout("mdm", 8), temperature=0.0)
