"""The training loop reads metrics back only at log / eval / checkpoint steps, and still never saves a NaN."""

import math

import jax
import jax.numpy as jnp
import pytest
from helpers.train_utils import smoke_config

from refusion_jax.checkpoints.orbax import Checkpoints
from refusion_jax.training import loop as train


def _record_syncs(monkeypatch) -> list[list[int]]:
  """The steps read back at each host sync."""
  syncs = []
  sync = train._DeviceQueue.sync

  def recording(self, *args):
    syncs.append([step for step, _ in self.pending])
    return sync(self, *args)

  monkeypatch.setattr(train._DeviceQueue, "sync", recording)
  return syncs


def test_host_syncs_only_at_log_and_checkpoint_steps(tmp_path, data_dir, monkeypatch):
  config = smoke_config(data_dir, num_train_steps=7, eval_every=0, log_every=3)
  config.checkpoint.every = 5
  syncs = _record_syncs(monkeypatch)
  result = train.train_and_evaluate(config, str(tmp_path))
  assert syncs == [[1, 2, 3], [4, 5], [6], [7]]  # log at 3 and 6, save at 5, the end at 7
  assert sorted(result.losses) == list(range(1, 8)) and all(math.isfinite(v) for v in result.losses.values())


def test_nan_between_syncs_is_caught_before_the_save(tmp_path, data_dir, monkeypatch):
  config = smoke_config(data_dir, num_train_steps=8, eval_every=0, log_every=100)
  config.optimizer.lr = 1e30  # the parameters blow up after the first real update
  config.checkpoint.every = 4
  syncs = _record_syncs(monkeypatch)
  with pytest.raises(train.NonFiniteLossError, match=r"at step \d+ .*last good checkpoint is step None"):
    train.train_and_evaluate(config, str(tmp_path))
  assert syncs == [[1, 2, 3, 4]]
  with Checkpoints(str(tmp_path / "checkpoints")) as checkpoints:
    assert checkpoints.all_steps() == []


def test_host_runs_at_most_two_steps_ahead_of_the_device(tmp_path, data_dir, monkeypatch):
  # A slow device: each step's loss goes through a long loop. Unbounded, the host (syncing only at the end here)
  # would dispatch every step at once, and a SIGTERM would wait for all of them before it could save.
  from refusion_jax.training import state

  slow = jax.jit(lambda x: x + 0.0 * jax.lax.fori_loop(0, 5_000_000, lambda i, v: jnp.sin(v) + 1.0, x))
  real = state.Placement.jit_step
  behind = []  # at each dispatch: the earlier steps the device has not finished

  def slow_steps(self, step_fn):
    jitted, losses = real(self, step_fn), []

    def run(*args):
      behind.append(sum(not loss.is_ready() for loss in losses))
      new_state, metrics = jitted(*args)
      metrics = dict(metrics, loss=slow(metrics["loss"]))
      losses.append(metrics["loss"])
      return new_state, metrics

    return run

  monkeypatch.setattr(state.Placement, "jit_step", slow_steps)
  config = smoke_config(data_dir, num_train_steps=10, eval_every=0, log_every=100)
  config.checkpoint.every = 1000
  syncs = _record_syncs(monkeypatch)
  train.train_and_evaluate(config, str(tmp_path))
  assert syncs == [list(range(1, 11))]  # still one sync, at the end
  assert len(behind) == 10 and max(behind) <= 2, behind
