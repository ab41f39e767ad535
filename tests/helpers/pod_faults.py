"""A two-process training job on this CPU, and faults sent to one of its processes (tests/test_pod_faults.py).

Run as a program, it measures the seconds from a fault to the other process's exit, per case (results/faults.md):

    JAX_PLATFORMS=cpu python tests/helpers/pod_faults.py /tmp/pod_faults [CASES]   # CASES: e.g. 0,4 (default: all)

Each case starts the job (the smoke demo, one CPU device per process), waits for its first checkpoint, sends
the signal, and times the survivor; the built data and JAX's compilation cache are shared by the cases.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The line a process ends with on a fault: its index, what happened, the step reached, where a restart resumes.
LINE = re.compile(r"refusion_jax: process (\d): (.*)\. The run reached step (\d+); a restart resumes from (.*)\. Exit")
# A job that would go on for long: a fault or stop_after_step ends it.
LONG = "--config.num_train_steps=100000"
# The coordinator's port of the jobs this process starts.
PORT = 20000 + os.getpid() % 20000


def start(workdir, shared: tuple[str, str], *overrides: str) -> list[subprocess.Popen]:
  """The two processes of launch/local_multiprocess.sh (one CPU device each), started here to know their pids."""
  data_dir, cache = shared
  processes = []
  for index in range(2):
    env = dict(
      os.environ,
      REFUSION_DISTRIBUTED="1",
      JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{PORT}",
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


def wait_for_checkpoint(workdir, processes: list[subprocess.Popen], after: int) -> None:
  """Until the job has saved a checkpoint past step `after`."""
  deadline = time.monotonic() + 240
  while time.monotonic() < deadline:
    assert all(p.poll() is None for p in processes), logs(workdir)
    if steps(workdir) and max(steps(workdir)) > after:
      return
    time.sleep(0.2)
  raise AssertionError(f"no checkpoint past step {after} in time: {logs(workdir)}")


def service_processes() -> list[int]:
  """The pids of the coordination service processes (training/coordinator.py) of the jobs started here."""
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
      continue
    if "refusion_jax.training.coordinator" in command and f":{PORT}" in command:
      found.append(int(pid))
  return found


def steps(workdir) -> list[int]:
  """The job's complete checkpoint steps."""
  directory = workdir / "checkpoints"
  return [int(name) for name in os.listdir(directory) if name.isdigit()] if directory.is_dir() else []


def logs(workdir) -> dict[int, str]:
  """Each process's output, by process index."""
  return {i: (workdir / f"process_{i}.log").read_text() for i in range(2)}


def fault_one(
  workdir, processes: list[subprocess.Popen], fault: signal.Signals, victim: int, after: int, service: bool = False
):
  """Once the job has saved past step `after`, send `fault` to process `victim` (and with `service`, to the job's
  coordination service process too: its host lost) and wait for the other to exit. Returns the seconds from the
  fault to that exit, its status and its log."""
  try:
    wait_for_checkpoint(workdir, processes, after)
    for pid in service_processes() if service else ():
      os.kill(pid, fault)
    os.kill(processes[victim].pid, fault)
    faulted = time.monotonic()
    status = processes[1 - victim].wait(timeout=120)
    seconds = time.monotonic() - faulted
  finally:
    for process in processes:  # the victim too: what a launcher does with a job that ended
      process.kill()
      process.wait()
    for pid in service_processes() if service else ():  # a stopped one does not exit by itself
      os.kill(pid, signal.SIGKILL)
  return seconds, status, logs(workdir)[1 - victim]


# (name, signal, process sent it, config overrides, whether the coordination service process gets it too)
CASES = (
  ("SIGKILL of process 1", signal.SIGKILL, 1, (), False),
  ("SIGKILL of process 0", signal.SIGKILL, 0, (), False),
  ("SIGSTOP of process 1", signal.SIGSTOP, 1, (), False),
  ("SIGSTOP of process 0", signal.SIGSTOP, 0, (), False),
  ("SIGSTOP of process 1, step_timeout_s=5", signal.SIGSTOP, 1, ("--config.faults.step_timeout_s=5",), False),
  ("SIGSTOP of process 0 and the coordination service (host 0 silent)", signal.SIGSTOP, 0, (), True),
  ("SIGKILL of process 0 and the coordination service", signal.SIGKILL, 0, (), True),
)


def main(root: str, cases: str = "") -> None:
  """Measure every case (or those numbered in `cases`, e.g. "0,4") in jobs under `root`."""
  root_dir = Path(root)
  shared = (str(root_dir / "data"), str(root_dir / "compilation_cache"))
  print("| case | the other's exit after the fault (s) | status | its last words |\n| --- | ---: | ---: | --- |")
  for number, (name, fault, victim, overrides, service) in enumerate(CASES):
    if cases and str(number) not in cases.split(","):
      continue
    workdir = root_dir / f"case_{number}"
    workdir.mkdir(parents=True)
    processes = start(workdir, shared, LONG, *overrides)
    seconds, status, log = fault_one(workdir, processes, fault, victim, after=0, service=service)
    line = LINE.search(log)
    words = line.group(2) if line else next(w for w in log.splitlines() if w.startswith("F"))[:160]
    print(f"| {name} | {seconds:.1f} | {status} | {words} |", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
