"""The replay of a rollout's log-probabilities (refusion_jax.rl.replay, docs/rl.md §2) against an eager reference
that runs each cycle's forwards with a KV cache, and its promises: no [rows, length, vocab] logits, gradients."""

from __future__ import annotations

import textwrap
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import fake_devices, replay_reference
from helpers.decode_cases import random_weights
from helpers.replay_reference import Layout

from refusion_jax.decoding.prompts import pad_prompts
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import init_model
from refusion_jax.parallel.compiled import sub_jaxprs
from refusion_jax.rl import replay

VOCAB, MASK, EOS = 24, 23, 5
STATIC = ("method", "tail_length", "chunk", "mask_id", "eos_id", "prompt_padding")


def random_model(seed: int):
  model = init_model(tiny(vocab_size=VOCAB))
  return random_weights(model, seed=seed, weight_std=0.3, head_std=1.0)


def random_rollouts(rng, method, rows: int) -> tuple[list[list[int]], replay.Trajectory]:
  return replay_reference.random_rollouts(rng, method, rows, vocab_size=VOCAB, eos_id=EOS)


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
  # The first of a few seeds whose case holds EOS-cut answers (NaN) and tokens the filters keep (finite); crc32,
  # not hash(): str hashes change with each process's PYTHONHASHSEED, and so did the case.
  full = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0) | sampling
  for attempt in range(8):
    rng = np.random.default_rng(zlib.crc32(repr((method, sorted(sampling.items()), attempt)).encode()))
    model = random_model(int(rng.integers(1 << 30)))
    prompts, rollout = random_rollouts(rng, method, rows=6)
    want = reference(model, prompts, rollout, method, full)
    if np.isnan(want).any() and np.isfinite(want).any():
      break
  assert np.isnan(want).any() and np.isfinite(want).any(), "no seed gave EOS-cut answers with kept tokens"
  ids, lengths = pad_prompts(prompts, pad_id=0)
  got = replay_jit(model, ids, lengths, rollout, method, mask_id=MASK, eos_id=EOS, chunk=5, **full)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", [METHODS[0], METHODS[2]], ids=lambda m: m.name)
def test_left_padded_prompts_replay_as_right_padded_ones(method):
  rng = np.random.default_rng(5)
  model = random_model(9)
  prompts, rollout = random_rollouts(rng, method, rows=5)
  right, lengths = pad_prompts(prompts, pad_id=0)
  left = np.full_like(right, 17)  # any id: padding is never seen
  for row, prompt in enumerate(prompts):
    left[row, right.shape[1] - len(prompt) :] = prompt
  kwargs = dict(mask_id=MASK, eos_id=EOS, temperature=0.8)
  from_right = replay_jit(model, right, lengths, rollout, method, **kwargs)
  from_left = replay_jit(model, left, lengths, rollout, method, prompt_padding="left", **kwargs)
  np.testing.assert_allclose(from_left, from_right, rtol=1e-6, atol=1e-5)


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
  with pytest.raises(ValueError, match="padded"):
    replay.trajectory_logprobs(model, ids, lengths, rollout, Layout("ar", 8), temperature=0.0, prompt_padding="up")
  with pytest.raises(ValueError, match="MDM"):
    replay.trajectory_logprobs(model, ids, lengths, rollout, Layout("mdm", 8), temperature=0.0)


# Runs in a subprocess: the device count must be set before JAX initialises.
_SHARDED = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, "tests")
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_default_matmul_precision", "highest")
    import jax.numpy as jnp, numpy as np
    from flax import nnx
    from helpers import replay_reference
    from helpers.decode_cases import random_weights
    from refusion_jax.model.config import tiny
    from refusion_jax.model.transformer import init_model
    from refusion_jax.parallel import sharding
    from refusion_jax.parallel.activations import sharded_activations
    from refusion_jax.rl import replay
    from refusion_jax.decoding.prompts import pad_prompts
    import refusion_jax as rj
    VOCAB, MASK, EOS = 24, 23, 5

    method = rj.ReFusion(gen_length=8, slot_size=2, acceptance="speculative")
    rng = np.random.default_rng(3)
    prompts, rollout = replay_reference.random_rollouts(rng, method, rows=8, vocab_size=VOCAB, eos_id=EOS)
    ids, lengths = pad_prompts(prompts, pad_id=0)
    model = random_weights(init_model(tiny(vocab_size=VOCAB)), seed=2, weight_std=0.3, head_std=1.0)
    graphdef, params = nnx.split(model)

    def total(params, ids, lengths, rollout):
      logprobs = replay.trajectory_logprobs(nnx.merge(graphdef, params), ids, lengths, rollout, method,
                                            temperature=0.9, mask_id=MASK, eos_id=EOS, chunk=3)
      return jnp.sum(jnp.where(jnp.isnan(logprobs), 0.0, logprobs)), logprobs

    def run(mesh_shape, devices):
      mesh = sharding.make_mesh(mesh_shape, devices)
      placed = jax.device_put(params, sharding.state_shardings(params, mesh))
      rows = lambda x: jax.device_put(x, sharding.batch_sharding(mesh, np.ndim(x)))
      step = jax.jit(sharded_activations(jax.value_and_grad(total, has_aux=True), mesh))
      (value, logprobs), grads = step(placed, rows(ids), rows(lengths), jax.tree.map(rows, rollout))
      flat = {str(k): np.asarray(v) for k, v in nnx.to_flat_state(jax.device_get(grads))}
      return float(value), np.asarray(logprobs), flat, logprobs.sharding.spec

    single = run({"data": 1}, jax.devices()[:1])
    split = run({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices())
    print(json.dumps(dict(
        values=[single[0], split[0]],
        logprob_diff=float(np.nanmax(np.abs(single[1] - split[1]))),
        same_nans=bool((np.isnan(single[1]) == np.isnan(split[1])).all()),
        grad_diff=max(float(np.max(np.abs(single[2][k] - split[2][k]))) for k in single[2]),
        grad_scale=max(float(np.max(np.abs(single[2][k]))) for k in single[2]),
        rows_spec=str(split[3][0]))))
""")


@pytest.mark.slow  # two compilations of the replay's gradient, one on 8 fake devices (~40 s of a loaded CPU)
def test_sharded_replay_and_its_gradients_equal_one_devices():
  report = fake_devices.run_json(_SHARDED)
  np.testing.assert_allclose(report["values"][1], report["values"][0], rtol=1e-5)
  assert report["logprob_diff"] < 1e-4 and report["same_nans"]
  assert report["grad_diff"] < 1e-5 * report["grad_scale"], report  # float32 sums in another order
  assert "data" in report["rows_spec"], report  # rows stay split over the data axes
