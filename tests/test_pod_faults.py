"""Pod faults (training/faults.py): a process of a two-process run killed (SIGKILL) or stopped (SIGSTOP) ends the
other within seconds, with one line and the restart status, and running the job again resumes from the checkpoint
that line names; process 0 too, whose coordination service runs apart (training/coordinator.py); the step watchdog
leaves compiling, evaluating and saving alone, and times the start of a run."""

import re
import signal
import time

import ml_collections
import pytest
from helpers.pod_faults import LINE, LONG, fault_one, logs, service_processes, start, steps

from refusion_jax.training import faults


def _faults(heartbeat_timeout_s: float = 10, step_timeout_s: float = 0.5, **more: float) -> ml_collections.ConfigDict:
  settings = {"startup_timeout_s": 60, "initialization_timeout_s": 60, "shutdown_timeout_s": 60, **more}
  return ml_collections.ConfigDict(
    dict(heartbeat_timeout_s=heartbeat_timeout_s, step_timeout_s=step_timeout_s, **settings)
  )


class _Exits:
  """Stands in for os._exit: records the status instead of ending the test."""

  def __init__(self):
    self.statuses: list[int] = []

  def __call__(self, status: int) -> None:
    self.statuses.append(status)


# ------------------------------------------------------------------ the step watchdog, in this process


def test_a_long_first_step_evaluation_or_save_does_not_trip_the_step_watchdog(tmp_path):
  exits = _Exits()
  watch = faults.FaultWatch(_faults(step_timeout_s=0.2), str(tmp_path), exit_=exits)
  try:
    watch.starting("restoring its newest checkpoint")
    time.sleep(0.4)  # the start of the run: longer than the step timeout
    watch.step_begins(1, timed=False)  # the first step compiles
    time.sleep(0.8)  # longer than the step timeout, shorter than _PAUSE_FACTOR of them
    watch.step_begins(2)
    with watch.paused("evaluating at step 2"):
      time.sleep(0.8)
    watch.steps_over()  # the run's last save and report
    time.sleep(0.8)
  finally:
    watch.close()
  assert exits.statuses == []


def _wait_for_exit(exits, seconds: float = 10) -> None:
  """Until the watch has asked to exit, at most `seconds`."""
  deadline = time.monotonic() + seconds
  while not exits.statuses and time.monotonic() < deadline:
    time.sleep(0.1)


def test_a_step_past_its_timeout_ends_the_run_with_the_restart_status(tmp_path, capsys):
  (tmp_path / "7").mkdir()  # a complete checkpoint
  (tmp_path / "9.orbax-checkpoint-tmp-123").mkdir()  # a save that never completed
  exits = _Exits()
  watch = faults.FaultWatch(_faults(step_timeout_s=0.5), str(tmp_path), exit_=exits)
  try:
    watch.step_begins(9)
    _wait_for_exit(exits)
  finally:
    watch.close()
  assert exits.statuses == [faults.RESTART_STATUS]
  process, what, step, resume = LINE.search(capsys.readouterr().err).groups()
  assert (process, step) == ("0", "8")
  assert what.startswith("train step 9 did not complete in 1 s (faults.step_timeout_s=0.5)")
  assert resume == f"checkpoint step 7 in {tmp_path}"


def test_a_save_that_never_ends_is_a_stall_too(tmp_path, capsys):
  exits = _Exits()
  watch = faults.FaultWatch(_faults(step_timeout_s=0.1), str(tmp_path), exit_=exits)
  try:
    watch.step_begins(5)
    with watch.paused("saving at step 4"):  # a filesystem that stopped answering
      _wait_for_exit(exits)
  finally:
    watch.close()
  assert exits.statuses == [faults.RESTART_STATUS]
  assert "saving at step 4 did not end in " in capsys.readouterr().err


def test_a_start_that_never_reaches_its_first_step_ends_the_run(tmp_path, capsys):
  exits = _Exits()
  watch = faults.FaultWatch(_faults(heartbeat_timeout_s=1, startup_timeout_s=0.5), str(tmp_path), exit_=exits)
  try:
    watch.starting("restoring its newest checkpoint")  # a filesystem that stopped answering
    _wait_for_exit(exits)
  finally:
    watch.close()
  assert exits.statuses == [faults.RESTART_STATUS]
  process, what, step, resume = LINE.search(capsys.readouterr().err).groups()
  assert (process, step, resume) == ("0", "0", "the start (no checkpoint was complete)")
  assert re.fullmatch(
    r"the start of this run \(restoring its newest checkpoint\) did not end in \d s \(faults.startup_timeout_s=0.5\)",
    what,
  )


def test_processes_that_do_not_all_join_end_this_one_with_the_restart_status(tmp_path, capsys):
  exits = _Exits()
  with faults.joining(_faults(initialization_timeout_s=0.2), str(tmp_path), index=1, exit_=exits):
    _wait_for_exit(exits)  # jax.distributed.initialize waiting for a process that never comes
  assert exits.statuses == [faults.RESTART_STATUS]
  line = re.search(
    r"refusion_jax: process 1: (.*)\. Nothing was trained in this start; a restart resumes from",
    capsys.readouterr().err,
  )
  assert line is not None and line.group(1).startswith("the job's processes did not all join within 0.2 s")
  # JAX's own timeout, which aborts the process, comes later.
  assert faults.jax_distributed_timeouts(_faults(initialization_timeout_s=300))["initialization_timeout"] > 300


def test_timeouts_that_cannot_work_are_refused_naming_the_field():
  with pytest.raises(ValueError, match="faults.heartbeat_timeout_s"):
    faults.jax_distributed_timeouts(_faults(heartbeat_timeout_s=0))
  with pytest.raises(ValueError, match="faults.step_timeout_s"):
    faults.jax_distributed_timeouts(_faults(step_timeout_s=-1))
  with pytest.raises(ValueError, match="faults.startup_timeout_s"):
    faults.jax_distributed_timeouts(_faults(startup_timeout_s=-1))


# ------------------------------------------------------------------ two processes, one lost or stopped


@pytest.fixture(scope="module")
def shared(data_dir, tmp_path_factory) -> tuple[str, str]:
  """What every start of a job here shares: the built data and JAX's compilation cache (a restart then compiles
  nothing, and the test takes a third less time)."""
  return data_dir, str(tmp_path_factory.mktemp("compilation_cache"))


def _ended_by_its_line(workdir, processes, fault: signal.Signals, victim: int, after: int):
  """`fault_one`, and the other process exited with the restart status and its line, no traceback or abort dump.
  Returns the seconds from the fault to that exit, the line, and the checkpoint step it names."""
  seconds, status, log = fault_one(workdir, processes, fault, victim, after)
  assert status == faults.RESTART_STATUS, log
  line = LINE.search(log)
  assert line is not None and "Traceback" not in log and "Check failure" not in log, log
  resume = int(re.fullmatch(r"checkpoint step (\d+) in .*", line.group(4)).group(1))
  assert resume > after and resume in steps(workdir)
  return seconds, line, resume


def test_a_killed_or_stopped_process_ends_the_job_with_a_line_and_a_restart_resumes_from_its_checkpoint(
  tmp_path, shared
):
  """One job, started three times (each start costs most of this test's time): a process killed, then one
  stopped, then a restart that runs to its end."""
  step_timeout_s = 5
  job = (shared, LONG, f"--config.faults.step_timeout_s={step_timeout_s}")

  # A lost process (SIGKILL of process 1): found by the heartbeats of process 0, within 30 s.
  seconds, line, resume = _ended_by_its_line(tmp_path, start(tmp_path, *job), signal.SIGKILL, victim=1, after=0)
  assert seconds < 30
  assert line.group(1) == "0" and re.match(r"process 1 \(host .+\) was lost: no heartbeat for", line.group(2))
  print(f"SIGKILL: process 0 exited {seconds:.1f} s after the fault, naming step {resume}")

  # A stalled process (SIGSTOP of process 0): found by the step watchdog of process 1.
  restarted = start(tmp_path, *job)
  first_resume = resume
  stopped_at, line, resume = _ended_by_its_line(tmp_path, restarted, signal.SIGSTOP, victim=0, after=resume)
  assert f"Resumed from {tmp_path / 'checkpoints'} at step {first_resume}." in logs(tmp_path)[0]
  assert stopped_at < step_timeout_s + 30
  # The step watchdog names the process that did not arrive; when process 1 was saving (a phase the watchdog gives
  # more time), the heartbeats find process 0 silent first.
  watchdog = f"s (faults.step_timeout_s={step_timeout_s}); processes that did not arrive: 0 (host "
  assert line.group(1) == "1", line.group(0)
  assert watchdog in line.group(2) or re.match(r"process 0 \(host .+\) was lost", line.group(2)), line.group(0)
  print(f"SIGSTOP: process 1 exited {stopped_at:.1f} s after the fault, naming step {resume}")

  # The job run again resumes from the checkpoint named and runs to its end (here: 3 steps more).
  statuses = [p.wait(timeout=240) for p in start(tmp_path, *job, f"--config.stop_after_step={resume + 3}")]
  final = logs(tmp_path)
  assert statuses == [0, 0], final
  assert f"at step {resume}." in final[0] and f"Stopping at step {resume + 3} (stop_after_step)" in final[0], final[0]


def test_a_killed_process_0_ends_the_other_with_a_line_and_a_restart_finishes_the_run(tmp_path, shared):
  """Process 0 runs no coordination service: its own process does (training/coordinator.py), which outlives it
  (in process 0, JAX would abort the other process at once, status 134) and ends with the job."""
  job = (shared, LONG)
  processes = start(tmp_path, *job)
  seconds, line, resume = _ended_by_its_line(tmp_path, processes, signal.SIGKILL, victim=0, after=0)
  assert seconds < 30
  assert line.group(1) == "1" and re.match(r"process 0 \(host .+\) was lost: no heartbeat for", line.group(2))
  print(f"SIGKILL of process 0: process 1 exited {seconds:.1f} s after the fault, naming step {resume}")

  restarted = start(tmp_path, *job, f"--config.stop_after_step={resume + 1}")
  statuses = [p.wait(timeout=240) for p in restarted]
  final = logs(tmp_path)
  assert statuses == [0, 0], final
  assert f"at step {resume}." in final[0] and f"Stopping at step {resume + 1} (stop_after_step)" in final[0], final[0]
  deadline = time.monotonic() + 10  # the service process exits with its last client
  while service_processes() and time.monotonic() < deadline:
    time.sleep(0.2)
  assert not service_processes()
