"""One run per workdir: a lock file naming the host and process that holds it.

Two runs writing one workdir would interleave checkpoints and corrupt the
data iterator states, so `train_and_evaluate` takes `workdir/run.lock` first.
The lock is a JSON file {host, pid, start}, created atomically (O_EXCL):

- held by a live process, or by a process on another host (whose liveness
  cannot be checked from here): the new run refuses, naming the holder;
- left by a dead process of this host (killed with SIGKILL, a crashed VM
  that rebooted): taken over with a warning.

`start` is the holder's start time from /proc, so a recycled pid is not
mistaken for the holder.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

LOCK_NAME = "run.lock"
# An empty lock file younger than this is one that another run is writing.
_WRITE_GRACE_S = 10.0


class WorkdirLockedError(RuntimeError):
  """Another live run holds the workdir."""


def _process_start(pid: int) -> str | None:
  """The start time of process `pid` (clock ticks since boot), or None where /proc cannot tell."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      # The command name (field 2) may hold spaces; the fields after its ")" are fixed.
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _alive(holder: dict) -> bool:
  """Whether the process that wrote `holder` still runs (assumed so for another host)."""
  if holder.get("host") != socket.gethostname() or holder.get("pid") == "?":
    return True
  pid = int(holder.get("pid", -1))
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # a live process of another user
    return True
  start = _process_start(pid)
  return start is None or holder.get("start") in (None, start)


def _age_s(path: str) -> float:
  try:
    return time.time() - os.path.getmtime(path)
  except OSError:
    return float("inf")


def _read(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}  # unreadable or half-written


def _create(path: str, content: dict) -> bool:
  try:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  except FileExistsError:
    return False
  with os.fdopen(fd, "w", encoding="utf-8") as f:
    json.dump(content, f)
  return True


def acquire(workdir: str) -> str:
  """Take `workdir`'s lock for this process; returns the lock file's path.

  Raises:
    WorkdirLockedError: a live run (or one on another host) holds it.
  """
  path = os.path.join(workdir, LOCK_NAME)
  mine = dict(host=socket.gethostname(), pid=os.getpid(), start=_process_start(os.getpid()))
  for _ in range(3):  # a lost race with another run taking over the same stale lock retries
    if _create(path, mine):
      return path
    holder = _read(path)
    if not holder and _age_s(path) < _WRITE_GRACE_S:  # just created by another run, not yet written
      holder = dict(host="?", pid="?")
    if holder and _alive(holder):
      raise WorkdirLockedError(
        f"{workdir} is in use by another run (process {holder.get('pid')} on host {holder.get('host')!r}, "
        f"lock file {path}). Wait for it to finish or stop it, or give this run another --workdir. If that "
        "process is gone (another host cannot be checked from here), delete the lock file."
      )
    # Renamed aside rather than deleted: of two runs taking over at once, only one rename succeeds.
    stale = f"{path}.stale.{os.getpid()}"
    try:
      os.rename(path, stale)
    except FileNotFoundError:
      continue
    os.remove(stale)
    logging.warning(
      "Took over the lock of %s left by process %s on %s, which no longer runs.",
      workdir,
      holder.get("pid"),
      holder.get("host"),
    )
  raise WorkdirLockedError(f"Could not take the lock {path}: other runs keep taking it. Start one run at a time.")


def release(path: str) -> None:
  """Remove the lock if this process still holds it."""
  holder = _read(path)
  if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
    os.remove(path)


@contextmanager
def workdir_lock(workdir: str) -> Iterator[str | None]:
  """Hold `workdir`'s lock for the duration of the block (see `acquire`); yields the lock file's path where this
  process holds it, else None.

  In a multi-process job process 0 holds it for all; every process fails
  together when it cannot be taken.

  Raises:
    WorkdirLockedError: a live run (or one on another host) holds it.
  """
  path, refusal = None, ""
  if jax.process_index() == 0:
    try:
      path = acquire(workdir)
    except WorkdirLockedError as error:
      refusal = str(error)
  if not multihost_utils.broadcast_one_to_all(np.int32(not refusal)):
    raise WorkdirLockedError(refusal or f"Process 0 could not lock {workdir}; see its log.")
  try:
    yield path
  finally:
    if path is not None:
      release(path)
