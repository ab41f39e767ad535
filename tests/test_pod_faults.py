"""Pod faults (training/faults.py): a process of a two-process run killed (SIGKILL) or stopped (SIGSTOP) ends the
other within seconds, with one line and the restart status, and running the job again resumes from the checkpoint
that line names; the step watchdog leaves compiling, evaluating and saving alone."""

import os
import re
import signal
import subprocess
import sys
import time

import ml_collections
import pytest
from helpers.train_utils import REPO

from refusion_jax.training import faults

# A run that would go on for long: each test ends it, by a fault or by stop_after_step.
_STEPS = 100_000
_LINE = re.compile(r"refusion_jax: process (\d): (.*)\. The run reached step (\d+); a restart resumes from (.*)\. Exit")


def _faults(heartbeat_timeout_s: float = 10, step_timeout_s: float = 0.5) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(heartbeat_timeout_s=heartbeat_timeout_s, step_timeout_s=step_timeout_s))


class _Exits:
  """Stands in for os._exit: records the status instead of ending the test."""

  def __init__(self):
    self.statuses: list[int] = []

  def __call__(self, status: int) -> None:
    self.statuses.append(status)


# ------------------------------------------------------------------ the step watchdog, in this process


def test_a_long_first_step_evaluation_or_save_does_not_trip_the_step_watchdog(tmp_path):
  exits = _Exits()
  watch = faults.FaultWatch(_faults(step_timeout_s=0.5), str(tmp_path), exit_=exits)
  try:
    watch.step_begins(1, timed=False)  # the first step compiles
    time.sleep(1.5)
    watch.step_begins(2)
    with watch.paused():  # evaluating, saving
      time.sleep(1.5)
    watch.steps_over()  # the run's last save and report
    time.sleep(1.5)
  finally:
    watch.close()
  assert exits.statuses == []


def test_a_step_past_its_timeout_ends_the_run_with_the_restart_status(tmp_path, capsys):
  (tmp_path / "7").mkdir()  # a complete checkpoint
  (tmp_path / "9.orbax-checkpoint-tmp-123").mkdir()  # a save that never completed
  exits = _Exits()
  watch = faults.FaultWatch(_faults(step_timeout_s=0.5), str(tmp_path), exit_=exits)
  try:
    watch.step_begins(9)
    deadline = time.monotonic() + 10
    while not exits.statuses and time.monotonic() < deadline:
      time.sleep(0.1)
  finally:
    watch.close()
  assert exits.statuses == [faults.RESTART_STATUS]
  process, what, step, resume = _LINE.search(capsys.readouterr().err).groups()
  assert (process, step) == ("0", "8")
  assert what.startswith("train step 9 did not complete in 1 s (faults.step_timeout_s=0.5)")
  assert resume == f"checkpoint step 7 in {tmp_path}"


def test_timeouts_that_cannot_work_are_refused_naming_the_field():
  with pytest.raises(ValueError, match="faults.heartbeat_timeout_s"):
    faults.jax_distributed_timeouts(_faults(heartbeat_timeout_s=0))
  with pytest.raises(ValueError, match="faults.step_timeout_s"):
    faults.jax_distributed_timeouts(_faults(step_timeout_s=-1))


# ------------------------------------------------------------------ two processes, one lost or stopped


@pytest.fixture(scope="module")
def shared(data_dir, tmp_path_factory) -> tuple[str, str]:
  """What every start of a job here shares: the built data and JAX's compilation cache (a restart then compiles
  nothing, and the tests take a third less time)."""
  return data_dir, str(tmp_path_factory.mktemp("compilation_cache"))


def _start(workdir, shared: tuple[str, str], *overrides: str) -> list[subprocess.Popen]:
  """The two processes of launch/local_multiprocess.sh (one CPU device each), started here to know their pids."""
  data_dir, cache = shared
  port = 20000 + os.getpid() % 20000
  processes = []
  for index in range(2):
    env = dict(
      os.environ,
      REFUSION_DISTRIBUTED="1",
      JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
      JAX_NUM_PROCESSES="2",
      JAX_PROCESS_ID=str(index),
      JAX_PLATFORMS="cpu",
      XLA_FLAGS="--xla_force_host_platform_device_count=1",
      JAX_COMPILATION_CACHE_DIR=cache,
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    command = [sys.executable, "-m", "refusion_jax.train", "--config", "configs/demo.py:smoke", "--workdir"]
    command += [str(workdir), f"--config.data.data_dir={data_dir}", "--config.eval_every=0"]
    command += ["--config.checkpoint.every=5", *overrides]
    log = open(workdir / f"process_{index}.log", "w")  # noqa: SIM115 (the process writes it)
    processes.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
  return processes


def _wait_for_checkpoint(workdir, processes: list[subprocess.Popen]) -> None:
  """Until the run has saved a checkpoint after its first (so that it is past starting up)."""
  deadline = time.monotonic() + 240
  while time.monotonic() < deadline:
    assert all(p.poll() is None for p in processes), _logs(workdir)
    steps = (
      [int(n) for n in os.listdir(workdir / "checkpoints") if n.isdigit()] if (workdir / "checkpoints").is_dir() else []
    )
    if len(steps) >= 1 and max(steps) >= 10:
      return
    time.sleep(0.2)
  raise AssertionError(f"no checkpoint in time: {_logs(workdir)}")


def _logs(workdir) -> dict[int, str]:
  return {i: (workdir / f"process_{i}.log").read_text() for i in range(2)}


def _fault_then_restart(
  workdir, shared: tuple[str, str], fault: signal.Signals, victim: int, overrides: tuple[str, ...] = ()
) -> tuple[float, re.Match, str]:
  """Start the job, send `fault` to process `victim` once it has saved, wait for the other to exit with the restart
  status, then run the job again until 5 steps past the checkpoint named. Returns the seconds from the fault to
  the survivor's exit, its line and the restarted run's log of process 0."""
  processes = _start(workdir, shared, f"--config.num_train_steps={_STEPS}", *overrides)
  try:
    _wait_for_checkpoint(workdir, processes)
    os.kill(processes[victim].pid, fault)
    faulted = time.monotonic()
    survivor = processes[1 - victim]
    status = survivor.wait(timeout=120)
    seconds = time.monotonic() - faulted
  finally:
    for process in processes:
      process.kill()
      process.wait()
  log = _logs(workdir)[1 - victim]
  assert status == faults.RESTART_STATUS, log
  line = _LINE.search(log)
  assert line is not None and "Traceback" not in log and "Check failure" not in log, log
  resume = int(re.fullmatch(r"checkpoint step (\d+) in .*", line.group(4)).group(1))
  assert resume >= 10
  restarted = _start(
    workdir, shared, f"--config.num_train_steps={_STEPS}", f"--config.stop_after_step={resume + 5}", *overrides
  )
  statuses = [p.wait(timeout=240) for p in restarted]
  logs = _logs(workdir)
  assert statuses == [0, 0], logs
  assert f"at step {resume}." in logs[0] and f"Stopping at step {resume + 5} (stop_after_step)" in logs[0], logs[0]
  return seconds, line, logs[0]


def test_a_killed_process_ends_the_other_within_30_s_and_a_restart_resumes(tmp_path, shared):
  seconds, line, _ = _fault_then_restart(tmp_path, shared, signal.SIGKILL, victim=1)
  assert seconds < 30
  assert line.group(1) == "0" and line.group(2).startswith("process 1 (host ") and "was lost" in line.group(2)
  print(f"SIGKILL: the survivor exited {seconds:.1f} s after the fault")


def test_a_stopped_process_is_found_by_the_step_watchdog_and_a_restart_resumes(tmp_path, shared):
  step_timeout_s = 3
  seconds, line, _ = _fault_then_restart(
    tmp_path, shared, signal.SIGSTOP, victim=0, overrides=(f"--config.faults.step_timeout_s={step_timeout_s}",)
  )
  assert seconds < step_timeout_s + 30
  assert line.group(1) == "1" and "did not complete" in line.group(2), line.group(0)
  assert "processes that did not arrive: 0 (host " in line.group(2), line.group(0)
  print(f"SIGSTOP: the survivor exited {seconds:.1f} s after the fault")
