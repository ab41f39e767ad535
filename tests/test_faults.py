"""Faults real jobs meet: unusable data, signals while blocked, damaged checkpoints, two runs in one workdir,
disk trouble while saving. Each test provokes one and checks what the job does and what it keeps."""

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading

import orbax.checkpoint as ocp
import pytest
from helpers.train_utils import REPO, smoke_config

from refusion_jax.checkpoints.load import load
from refusion_jax.checkpoints.orbax import CheckpointDamagedError, Checkpoints, CheckpointSaveError
from refusion_jax.data.pipeline import DataError
from refusion_jax.training import inputs, loop, run_lock, start
from refusion_jax.training.interrupts import RunInterrupted


def _config(data_dir: str, **overrides):
  # In-process runs must never meet the watchdog's os._exit: a long grace.
  return smoke_config(data_dir, **{"eval_every": 0, "stop_grace_s": 300.0, **overrides})


def _steps(workdir) -> list[int]:
  with Checkpoints(os.path.join(workdir, "checkpoints")) as checkpoints:
    return checkpoints.all_steps()


# ------------------------------------------------------------------ signals


class _Stalling:
  """A training dataset whose iterator sends `signum` to this process and then blocks, after `after` batches."""

  def __init__(self, dataset, after: int, signum: int):
    self._dataset, self._after, self._signum = dataset, after, signum

  def __iter__(self):
    return _StallingIterator(iter(self._dataset), self._after, self._signum)


class _StallingIterator:
  def __init__(self, inner, after: int, signum: int):
    self._inner, self._left, self._signum = inner, after, signum

  def __next__(self):
    if self._left == 0:
      os.kill(os.getpid(), self._signum)
      threading.Event().wait(120)  # a data source that never delivers
      raise AssertionError("the signal did not interrupt the wait for data")
    self._left -= 1
    return next(self._inner)

  def get_state(self):
    return self._inner.get_state()

  def set_state(self, state):
    self._inner.set_state(state)


def _stall_training_data(monkeypatch, after: int, signum: int = signal.SIGTERM):
  real = inputs.batches

  def batches(source, tokenizer, config, *, train):
    dataset = real(source, tokenizer, config, train=train)
    return _Stalling(dataset, after, signum) if train else dataset

  monkeypatch.setattr(inputs, "batches", batches)


def test_sigterm_while_waiting_for_data_saves_the_last_step(tmp_path, data_dir, monkeypatch, capsys):
  workdir = str(tmp_path / "run")
  config = _config(data_dir, num_train_steps=1000)
  config.checkpoint.every = 1000
  _stall_training_data(monkeypatch, after=2)
  result = loop.train_and_evaluate(config, workdir)
  assert (result.step, result.stopped_by) == (2, "preempted")
  assert "Stopping at step 2 (preempted) on SIGTERM while waiting for training data" in capsys.readouterr().out
  assert _steps(workdir) == [2]
  assert not os.path.exists(os.path.join(workdir, run_lock.LOCK_NAME))  # released
  monkeypatch.undo()
  resumed = loop.train_and_evaluate(_config(data_dir, num_train_steps=1000, stop_after_step=3), workdir)
  assert sorted(resumed.losses) == [3]


def test_sigterm_in_a_lora_run_saves_its_adapters_and_the_resume_is_exact(tmp_path, data_dir, monkeypatch):
  # A LoRA run saves adapters and their optimizer state per step (the base once): the preemption save must be a
  # step that resumes into the same losses as a run never interrupted.
  def lora_config(**overrides):
    config = _config(data_dir, num_train_steps=5, **overrides)
    config.checkpoint.every = 1000
    config.lora.update(rank=4, dropout=0.1)
    return config

  straight = loop.train_and_evaluate(lora_config(), str(tmp_path / "straight"))
  workdir = str(tmp_path / "run")
  _stall_training_data(monkeypatch, after=2)
  stopped = loop.train_and_evaluate(lora_config(), workdir)
  assert (stopped.step, stopped.stopped_by) == (2, "preempted")
  assert _steps(workdir) == [2]
  monkeypatch.undo()
  resumed = loop.train_and_evaluate(lora_config(), workdir)
  assert sorted(resumed.losses) == [3, 4, 5]
  assert [resumed.losses[s] for s in (3, 4, 5)] == [straight.losses[s] for s in (3, 4, 5)]


def test_signal_before_the_first_step_stops_without_saving(tmp_path, data_dir, monkeypatch):
  _stall_training_data(monkeypatch, after=0, signum=signal.SIGINT)
  with pytest.raises(RunInterrupted, match="SIGINT while waiting for training data before the first step"):
    loop.train_and_evaluate(_config(data_dir, num_train_steps=1000), str(tmp_path))
  assert _steps(str(tmp_path)) == []


def test_sigterm_while_evaluating_saves_the_evaluated_step(tmp_path, data_dir, monkeypatch):
  def stuck_decoding(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Event().wait(120)
    raise AssertionError("the signal did not interrupt the evaluation")

  monkeypatch.setattr(loop, "evaluate_decoding", stuck_decoding)
  config = _config(data_dir, num_train_steps=1000)
  config.eval_every, config.checkpoint.every = 2, 1000
  result = loop.train_and_evaluate(config, str(tmp_path))
  assert (result.step, result.stopped_by) == (2, "preempted")
  assert _steps(str(tmp_path)) == [2]


def test_sigterm_while_restoring_stops_and_keeps_the_checkpoint(tmp_path, data_dir, monkeypatch):
  loop.train_and_evaluate(_config(data_dir, num_train_steps=1000, stop_after_step=1), str(tmp_path))

  def stuck_restore(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Event().wait(120)
    raise AssertionError("the signal did not interrupt the restore")

  monkeypatch.setattr(Checkpoints, "restore", stuck_restore)
  with pytest.raises(RunInterrupted, match="SIGTERM while restoring checkpoint step 1: nothing was trained"):
    loop.train_and_evaluate(_config(data_dir, num_train_steps=1000), str(tmp_path))
  assert _steps(str(tmp_path)) == [1]


def test_sigterm_during_a_step_stops_at_the_step_boundary_without_waiting_for_a_sync(
  tmp_path, data_dir, monkeypatch, capsys
):
  # The host syncs only at log / checkpoint steps (100 and 1000 here); a signal makes the next step boundary one.
  from refusion_jax.training import state

  real = state.Placement.jit_step

  def signalling_at_step_3(self, step_fn):
    jitted, calls = real(self, step_fn), []

    def run(*args):
      calls.append(1)
      if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the step is dispatched: not a blocking phase
      return jitted(*args)

    return run

  monkeypatch.setattr(state.Placement, "jit_step", signalling_at_step_3)
  workdir = str(tmp_path / "run")
  config = _config(data_dir, num_train_steps=1000, log_every=100)
  config.checkpoint.every = 1000
  result = loop.train_and_evaluate(config, workdir)
  assert (result.step, result.stopped_by, sorted(result.losses)) == (3, "preempted", [1, 2, 3])
  assert "Stopping at step 3 (preempted); checkpoint saved" in capsys.readouterr().out
  assert _steps(workdir) == [3]


# A run whose first train step stays in native code (an endless XLA computation), as a long compilation would.
_STUCK_IN_NATIVE_CODE = textwrap.dedent("""
  import jax, jax.numpy as jnp
  from absl import app, flags
  from ml_collections import config_flags
  from refusion_jax import train
  from refusion_jax.training import state

  def endless(x):
    inner = lambda i, v: jax.lax.fori_loop(0, 1 << 20, lambda j, w: w * 0.999 + 1.0, v)
    return jax.lax.fori_loop(0, 1 << 30, inner, x)

  def stuck(self, step_fn):
    def run(*args):
      print("STUCK", flush=True)
      # The main thread waits in C++: Python signal handlers cannot run until it returns.
      jax.jit(endless)(jnp.ones(())).block_until_ready()
    return run

  state.Placement.jit_step = stuck
  config_flags.DEFINE_config_file("config", None, "")
  flags.DEFINE_string("workdir", None, "")
  app.run(train.main)
""")


def _run_stuck(workdir: str, data_dir: str, grace_s: float, signals: int):
  """Start the stuck run, send `signals` SIGTERMs once it is stuck; returns (exit status, stderr)."""
  command = [
    sys.executable,
    "-c",
    _STUCK_IN_NATIVE_CODE,
    "--config=configs/demo.py:smoke",
    f"--workdir={workdir}",
    f"--config.data.data_dir={data_dir}",
    f"--config.stop_grace_s={grace_s}",
  ]
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  log = os.path.join(workdir + "-stderr.txt")  # a file, not a pipe: progress bars must not fill it and block
  with open(log, "w") as stderr:
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
      for line in process.stdout:
        if line.startswith("STUCK"):
          break
      for _ in range(signals):
        process.send_signal(signal.SIGTERM)
        threading.Event().wait(0.5)
      process.communicate(timeout=120)
    finally:
      process.kill()
  with open(log) as f:
    return process.returncode, f.read()


def test_sigterm_while_stuck_in_native_code_exits_after_the_grace_time(tmp_path, data_dir, caplog):
  workdir = str(tmp_path / "run")
  status, stderr = _run_stuck(workdir, data_dir, grace_s=2.0, signals=1)
  assert status == 128 + signal.SIGTERM, stderr[-3000:]
  assert "exiting at once on SIGTERM (running train step 1 (compiling it first) went on for more than 2 s" in stderr
  assert "Traceback" not in stderr
  # Killed inside a step, the run could not release its lock: the next run takes it over.
  with caplog.at_level("WARNING"):
    run_lock.release(run_lock.acquire(workdir))
  assert "which no longer runs" in caplog.text


def test_second_signal_exits_at_once(tmp_path, data_dir):
  status, stderr = _run_stuck(str(tmp_path), data_dir, grace_s=300.0, signals=2)
  assert status == 128 + signal.SIGTERM, stderr[-3000:]
  assert "exiting at once on SIGTERM (a second signal)" in stderr


# ------------------------------------------------------------------ unusable data


def test_cli_reports_data_that_never_fits_and_exits(tmp_path):
  # As the official release's train_data.json with the demo config: every record is longer than seq_len=64.
  records = [{"query": f"Question {i}: " + "why " * 20, "response": "because " * 10} for i in range(100)]
  train_file = tmp_path / "train_data.json"
  train_file.write_text(json.dumps(records))
  command = [
    sys.executable,
    "-m",
    "refusion_jax.train",
    "--config=configs/demo.py:smoke",
    f"--workdir={tmp_path / 'run'}",
    "--config.data.dataset=json",
    f"--config.data.train_files={train_file}",
  ]
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-3000:]
  shortest = min(len((r["query"] + r["response"]).encode()) + 1 for r in records)
  assert f"100 of the 100 examples of the train data (config.data.train_files={train_file})" in out.stderr
  assert "longer than seq_len=64" in out.stderr and f"raise seq_len to at least {shortest}" in out.stderr
  assert "Traceback" not in out.stderr


def test_validation_data_that_never_fits_is_reported_before_training(tmp_path, data_dir):
  records = [{"query": "q" * 80, "response": "r"}] * 5
  (tmp_path / "val.json").write_text(json.dumps(records))
  (tmp_path / "train.json").write_text(json.dumps([{"query": "1+1", "response": "2"}] * 8))
  config = _config(data_dir, num_train_steps=1000, eval_every=2)
  config.data.update(
    dataset="json",
    data_dir=str(tmp_path / "data"),
    train_files=str(tmp_path / "train.json"),
    validation_files=str(tmp_path / "val.json"),
  )
  with pytest.raises(DataError, match="5 of the 5 examples of the validation data"):
    loop.train_and_evaluate(config, str(tmp_path / "run"))
  assert _steps(str(tmp_path / "run")) == []


# ------------------------------------------------------------------ one run per workdir


def _write_lock(workdir, **holder):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, run_lock.LOCK_NAME), "w") as f:
    json.dump(holder, f)


def test_second_run_on_a_held_workdir_refuses_before_writing(tmp_path, data_dir):
  parent = os.getppid()  # a live process of this host
  _write_lock(tmp_path, host=socket.gethostname(), pid=parent, start=run_lock._process_start(parent))
  with pytest.raises(run_lock.WorkdirLockedError, match=rf"in use by another run \(process {parent} on host"):
    loop.train_and_evaluate(_config(data_dir), str(tmp_path))
  assert os.listdir(tmp_path) == [run_lock.LOCK_NAME]


def test_lock_of_another_host_is_respected(tmp_path):
  _write_lock(tmp_path, host="other-host", pid=1, start="1")
  with pytest.raises(run_lock.WorkdirLockedError, match="'other-host'"):
    run_lock.acquire(str(tmp_path))


def test_stale_lock_of_a_dead_or_recycled_process_is_taken_over_with_a_warning(tmp_path, caplog):
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
  recycled = dict(pid=os.getppid(), start="-1")  # a live pid, but not the process that wrote the lock
  for holder in (dict(pid=int(dead.stdout)), recycled):
    _write_lock(tmp_path, host=socket.gethostname(), **holder)
    caplog.clear()
    with caplog.at_level("WARNING"):
      path = run_lock.acquire(str(tmp_path))
    assert f"left by process {holder['pid']}" in caplog.text
    with open(path) as f:
      assert json.load(f)["pid"] == os.getpid()
    run_lock.release(path)
    assert not os.path.exists(path)


# ------------------------------------------------------------------ damaged checkpoints


@pytest.fixture(scope="module")
def trained_workdir(tmp_path_factory, data_dir):
  """A run of 4 steps with checkpoints at steps 2 and 4, and its losses."""
  workdir = str(tmp_path_factory.mktemp("trained"))
  config = _config(data_dir, num_train_steps=4)
  config.checkpoint.every = 2
  result = loop.train_and_evaluate(config, workdir)
  assert _steps(workdir) == [2, 4]
  return workdir, result.losses


def _truncate_arrays(step_dir: str) -> None:
  for root, _, names in os.walk(os.path.join(step_dir, "params")):
    if os.path.basename(root) == "d":  # the OCDBT array chunks
      for name in names:
        path = os.path.join(root, name)
        with open(path, "r+b") as f:
          f.truncate(os.path.getsize(path) // 2)


def _damaged_copy(trained_workdir, tmp_path, steps) -> str:
  workdir = str(tmp_path / "run")
  shutil.copytree(trained_workdir[0], workdir)
  for step in steps:
    _truncate_arrays(os.path.join(workdir, "checkpoints", str(step)))
  return workdir


def test_damaged_newest_step_is_set_aside_and_the_run_resumes_from_the_one_before(
  trained_workdir, tmp_path, data_dir, capsys
):
  workdir = _damaged_copy(trained_workdir, tmp_path, steps=[4])
  config = _config(data_dir, num_train_steps=4)
  config.checkpoint.every = 2
  result = loop.train_and_evaluate(config, workdir)
  out = capsys.readouterr().out
  assert "Checkpoint step 4 in" in out and "could not be read" in out and "Resumed from" in out
  # Resumed exactly from step 2: steps 3 and 4 repeat the first run's losses bit for bit.
  assert result.losses == {s: trained_workdir[1][s] for s in (3, 4)}
  moved = os.path.join(workdir, start.DAMAGED_SUBDIR, "4")
  assert os.path.isdir(os.path.join(moved, "params"))  # kept, not deleted
  assert _steps(workdir) == [2, 4]  # step 4 written anew


def test_damaged_step_with_on_corrupt_fail_stops_naming_it(trained_workdir, tmp_path, data_dir):
  workdir = _damaged_copy(trained_workdir, tmp_path, steps=[4])
  config = _config(data_dir, num_train_steps=6)
  config.checkpoint.on_corrupt = "fail"
  with pytest.raises(CheckpointDamagedError, match=r"step 4 .*could not be read.*on_corrupt='fail'"):
    loop.train_and_evaluate(config, workdir)
  assert _steps(workdir) == [2, 4]  # left in place


def test_every_step_damaged_never_starts_from_scratch(trained_workdir, tmp_path, data_dir):
  workdir = _damaged_copy(trained_workdir, tmp_path, steps=[2, 4])
  config = _config(data_dir, num_train_steps=6)
  for _ in range(2):  # the second attempt finds only the set-aside steps, and still refuses
    with pytest.raises(CheckpointDamagedError, match="refusing to start from scratch"):
      loop.train_and_evaluate(config, workdir)
  assert sorted(os.listdir(os.path.join(workdir, start.DAMAGED_SUBDIR))) == ["2", "4"]
  assert _steps(workdir) == []


# ------------------------------------------------------------------ disk trouble


class _FailedWrite:
  """An orbax commit future whose background write hits a full disk."""

  def result(self, timeout=None):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_failing_writer_keeps_the_last_good_checkpoint_and_stops(tmp_path, data_dir, monkeypatch):
  write = ocp.StandardCheckpointHandler.async_save

  async def failing_from_step_4(self, directory, *args, **kwargs):
    futures = await write(self, directory, *args, **kwargs)
    step = os.path.basename(os.path.dirname(str(directory))).split(".")[0]
    return [_FailedWrite()] if int(step) >= 4 else futures

  monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", failing_from_step_4)
  config = _config(data_dir, num_train_steps=8)
  config.checkpoint.every = 2
  with pytest.raises(CheckpointSaveError, match=r"step 4 .*No space left on device.*step 2, is intact"):
    loop.train_and_evaluate(config, str(tmp_path))
  monkeypatch.undo()
  assert _steps(str(tmp_path)) == [2]
  model, _ = load(str(tmp_path))  # readable
  assert model.config.num_layers == config.model.num_layers
  assert not os.path.exists(os.path.join(tmp_path, run_lock.LOCK_NAME))
