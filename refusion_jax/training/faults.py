"""Pod faults: a process that is lost or stalls ends the run on every process that can still act, in seconds.

A multi-process run fails as a whole: once one process is gone (a preempted or
broken host) or stuck (a filesystem that does not answer, a wedged driver),
the others wait for it in their next collective forever, or until JAX's own
heartbeat check aborts them with a C++ dump that names nothing of ours.
`FaultWatch` ends them first, each with one line that says what happened, the
step reached and the checkpoint a restart resumes from, and exit status
`RESTART_STATUS`, on which every launcher restarts the job (docs/scaling.md,
"When a host is lost or stalls"). Two checks, run by two daemon threads:

- **Lost** (`faults.heartbeat_timeout_s`): every process beats through the key-value
  store of `jax.distributed` (a counter, its step and whether its step clock is
  paused), and reads the others' beats. A process whose beat has not changed
  for the timeout is lost; a store that has not answered for the timeout means
  the coordinator (on process 0's host) is. JAX's own check gets enough more
  (`_jax_heartbeat_timeout_s`) that it stays a backstop: ours speaks first.
- **Stalled** (`faults.step_timeout_s`): a step that has not completed within the
  timeout ends the run, naming the processes whose beats had not reached it.
  The clock runs only between steps: evaluating and saving pause it
  (`FaultWatch.paused`), on this process or on any other (the beats say so), so a
  slow but live run is never ended; such a phase gets `_PAUSE_FACTOR` step timeouts
  of its own (a save on a dead filesystem stalls too). The start of the run, from
  the watch's creation (before the workdir's lock) to its first step dispatched
  (opening the data, restoring, compiling that step), gets `faults.startup_timeout_s`.

A dead process 0 is lost like any other because its coordination service runs in a process of its own
(training/coordinator.py): in process 0, JAX's client would abort every other process at once (status 134).

The beat thread does the store's I/O, which may block; the judge thread only
compares clocks, so it acts even while the store, the main thread and the
devices are stuck. Exiting is `os._exit`: nothing of this process runs after
the line (a save in flight never completes, and orbax only makes a step
visible once every process has committed it), so the checkpoint named stays
the newest complete one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

import jax
import ml_collections

# The exit status that means "restart me": a lost or stalled process, nothing wrong with the run itself. 75 is
# EX_TEMPFAIL of sysexits.h ("a temporary failure; the user is invited to retry"); launch/*.sh restart on it.
RESTART_STATUS = 75
# JAX's heartbeat and joining checks abort the process (a C++ fatal error, status 134): they come at least this many
# seconds after ours, so that ours, which names what happened and the checkpoint, always acts first.
_JAX_BACKSTOP_S = 10
# A slow phase (compiling, evaluating, saving) may take this many step timeouts before it counts as a stall.
_PAUSE_FACTOR = 10
# Beats per heartbeat timeout: a lost process is found within the timeout plus one beat.
_BEATS_PER_TIMEOUT = 5
# Seconds the line waits for the checkpoint directory to be listed (a stuck filesystem may never answer).
_LIST_PATIENCE_S = 3.0
# Keys of the store: each process's beat and host name.
_PREFIX, _HOSTS = "refusion_jax/beat/", "refusion_jax/host/"


def jax_distributed_timeouts(faults: ml_collections.ConfigDict) -> dict[str, int]:
  """The keyword arguments of `jax.distributed.initialize` that `config.faults` sets.

  Raises:
    ValueError: a timeout that cannot work (`_check_config`).
  """
  _check_config(faults)
  return dict(
    heartbeat_timeout_seconds=_jax_heartbeat_timeout_s(faults),
    initialization_timeout=int(faults.initialization_timeout_s) + _JAX_BACKSTOP_S,  # `joining` speaks first
    shutdown_timeout_seconds=int(faults.shutdown_timeout_s),
  )


def _jax_heartbeat_timeout_s(faults: ml_collections.ConfigDict) -> int:
  """JAX's own heartbeat timeout, long enough that its abort stays a backstop.

  JAX's client beats every half of its timeout, so its service may find a process lost as early as half the timeout
  after the loss (measured: 10.6 s after a SIGKILL with a timeout of 20 s). Ours finds it at the latest one
  timeout, two beats and a judge tick after the loss; half of JAX's timeout is that plus `_JAX_BACKSTOP_S`.
  """
  ours = float(faults.heartbeat_timeout_s)
  latest = ours * (1 + 2 / _BEATS_PER_TIMEOUT) + 1
  return math.ceil(2 * (latest + _JAX_BACKSTOP_S))


def _check_config(faults: ml_collections.ConfigDict) -> None:
  """Raises ValueError for a timeout that cannot work, naming the field."""
  if faults.heartbeat_timeout_s < 1:
    raise ValueError(f"faults.heartbeat_timeout_s={faults.heartbeat_timeout_s}; give at least 1 (seconds).")
  for field in ("step_timeout_s", "startup_timeout_s"):
    if faults[field] < 0:
      raise ValueError(f"faults.{field}={faults[field]}; give 0 (off) or a number of seconds.")


@dataclasses.dataclass
class _Phase:
  """A slow but live phase under way (starting, compiling, evaluating, saving): it ends the run past `limit_s`
  (0: never), naming `setting`, the field that gave the limit."""

  what: str
  since: float
  limit_s: float
  setting: str


@dataclasses.dataclass
class _Peer:
  """What this process knows of another: its last beat, when that beat last changed (local clock), its host."""

  beat: str = ""
  seen_at: float = 0.0
  host: str = ""

  @property
  def step(self) -> int:
    return int(self.beat.split()[1]) if self.beat else 0

  @property
  def paused(self) -> bool:
    return self.beat.endswith(" paused")

  @property
  def done(self) -> bool:
    """It ended its run normally (and may exit before this process does)."""
    return self.beat.endswith(" done")


class FaultWatch:
  """The two checks of the module docstring, for one run; `close` stops them (a run that ends normally)."""

  def __init__(
    self,
    faults: ml_collections.ConfigDict,
    checkpoint_dir: str,
    *,
    before_exit: Callable[[], None] = lambda: None,
    exit_: Callable[[int], None] = os._exit,
  ):
    """
    Args:
      faults: `config.faults` (heartbeat_timeout_s, step_timeout_s).
      checkpoint_dir: where the run's checkpoints are (named in the line).
      before_exit: run just before exiting on a fault (e.g. releasing the workdir's lock).
      exit_: how to end the process (tests replace it).
    """
    _check_config(faults)
    self._heartbeat_s = float(faults.heartbeat_timeout_s)
    self._step_timeout_s = float(faults.step_timeout_s)
    self._startup_timeout_s = float(faults.startup_timeout_s)
    self._checkpoint_dir, self._before_exit, self._exit = checkpoint_dir, before_exit, exit_
    self._index, self._count = jax.process_index(), jax.process_count()
    self.step = 0  # the step this process has reached (the loop sets it)
    self._timing = False  # between the loop's first timed step and its end
    self._step_clock: float | None = None  # when the step now awaited began; None: not timed yet or paused
    self._pauses = 0
    # The slow phase under way: from here to the first timed step, the start of the run.
    self._pause: _Phase | None = _Phase(
      "the start of this run (taking the workdir's lock, opening its checkpoints)",
      time.monotonic(),
      self._startup_timeout_s,
      f"faults.startup_timeout_s={self._startup_timeout_s:g}",
    )
    self._starting = True
    self._peers = {i: _Peer() for i in range(self._count) if i != self._index}
    self._answered_at = time.monotonic()  # the key-value store's last answer
    self._closed = threading.Event()
    self._finished = False  # closed by the run, not by a fault
    self._lock = threading.Lock()
    self._client = _client() if self._count > 1 else None
    self._threads = [threading.Thread(target=self._judge, name="refusion-fault-judge", daemon=True)]
    if self._client is not None:
      self._client.key_value_set(f"{_HOSTS}{self._index}", socket.gethostname(), allow_overwrite=True)
      self._threads.append(threading.Thread(target=self._beat, name="refusion-fault-beat", daemon=True))
    for thread in self._threads:
      thread.start()

  # ---------------------------------------------------------------- what the loop tells it

  def starting(self, what: str) -> None:
    """The start of the run now does `what` (building the data, restoring): named if it never ends."""
    with self._lock:
      if self._starting and self._pause is not None:
        self._pause.what = f"the start of this run ({what})"

  def step_begins(self, step: int, *, timed: bool = True) -> None:
    """The loop now works towards `step` (fetching its batch, dispatching it, waiting for the devices).

    timed: False for a step whose time is no measure of health (the first of a run, which compiles): still part
      of the run's start, or a slow phase of its own.
    """
    if not timed:
      self.starting(f"compiling train step {step}, its first")
    with self._lock:
      self.step, self._timing = step - 1, timed
      now = time.monotonic()
      self._step_clock = now if timed and not self._pauses else None
      if self._pauses:
        return
      if timed:
        self._starting, self._pause = False, None
      elif not self._starting:
        self._pause = self._slow(f"train step {step} (compiling it)", now)

  def steps_over(self) -> None:
    """The loop has ended: what follows (the last saves, the report) is no step, and is not timed."""
    with self._lock:
      self._timing, self._step_clock, self._starting = False, None, False
      if not self._pauses:
        self._pause = self._slow("the end of the run (its last saves)", time.monotonic())

  def _slow(self, what: str, since: float) -> _Phase:
    """A slow phase after the start: `_PAUSE_FACTOR` step timeouts."""
    limit_s = _PAUSE_FACTOR * self._step_timeout_s
    return _Phase(what, since, limit_s, f"{_PAUSE_FACTOR} x faults.step_timeout_s={self._step_timeout_s:g}")

  @contextlib.contextmanager
  def paused(self, what: str) -> Iterator[None]:
    """A slow but live phase (`what`: evaluating, saving): the step clock stops inside it, and the phase gets
    `_PAUSE_FACTOR` step timeouts instead (a filesystem that stops answering during a save is a stall too)."""
    with self._lock:
      self._pauses += 1
      self._step_clock, self._starting = None, False
      if self._pauses == 1:
        self._pause = self._slow(what, time.monotonic())
    try:
      yield
    finally:
      with self._lock:
        self._pauses -= 1
        if not self._pauses:
          self._pause = None
          if self._timing:
            self._step_clock = time.monotonic()

  def settle(self) -> None:
    """After the run failed in a multi-process job: give the checks the time to find a lost process.

    A collective with a process that died fails at once (a read error on its socket), well before the
    heartbeat timeout says which process it was; the line of `_end`, and the restart status, explain it better
    than that error. Returns when nothing was found (the error is then the run's own).
    """
    if self._client is not None:
      time.sleep(self._heartbeat_s + 2 * self._heartbeat_s / _BEATS_PER_TIMEOUT)  # `_end` exits meanwhile

  def close(self) -> None:
    """Stop both checks; the others then see this process as done, not lost (it may exit before them)."""
    self._finished = True
    self._closed.set()
    if len(self._threads) > 1:
      self._threads[1].join(timeout=_LIST_PATIENCE_S)  # its last beat, "done"

  # ---------------------------------------------------------------- the threads

  def _beat(self) -> None:
    """Publish this process's beat and read the others', every heartbeat timeout / `_BEATS_PER_TIMEOUT`."""
    count, interval = 0, self._heartbeat_s / _BEATS_PER_TIMEOUT
    while not self._closed.wait(0 if count == 0 else interval):
      count += 1
      paused = " paused" if self._step_clock is None else ""
      with contextlib.suppress(Exception):  # a store that does not answer: the judge counts its silence
        self._client.key_value_set(f"{_PREFIX}{self._index}", f"{count} {self.step}{paused}", allow_overwrite=True)
        self._heard(dict(self._client.key_value_dir_get(_PREFIX)), first=count == 1)
    if self._finished:
      with contextlib.suppress(Exception):
        self._client.key_value_set(f"{_PREFIX}{self._index}", f"{count} {self.step} done", allow_overwrite=True)

  def _heard(self, beats: dict[str, str], first: bool) -> None:
    """Take in the beats read from the store."""
    now = self._answered_at = time.monotonic()
    if any(not peer.host for peer in self._peers.values()):
      hosts = dict(self._client.key_value_dir_get(_HOSTS))
      for index, peer in self._peers.items():
        peer.host = hosts.get(f"{_HOSTS}{index}", "")
    for index, peer in self._peers.items():
      beat = beats.get(f"{_PREFIX}{index}", "")
      if beat == peer.beat and not first:
        continue  # silent: a peer that stopped while saving must not keep pausing this process's clock
      peer.beat, peer.seen_at = beat, now  # a peer not beating yet is timed from this process's first beat
      if peer.paused:  # another process compiles, evaluates or saves: this one's wait for it is no stall
        with self._lock:
          if self._step_clock is not None:
            self._step_clock = now

  def _judge(self) -> None:
    """Every beat: end the run when a process is lost or the step awaited is overdue."""
    while not self._closed.wait(min(1.0, self._heartbeat_s / _BEATS_PER_TIMEOUT)):
      now = time.monotonic()
      coordinator_done = self._index != 0 and self._peers[0].done  # its process may exit before this one
      if self._client is not None and not coordinator_done and now - self._answered_at > self._heartbeat_s:
        self._end(
          f"lost contact with process 0{self._host(0)}, which coordinates the job: its key-value store "
          f"has not answered for {now - self._answered_at:.0f} s (faults.heartbeat_timeout_s="
          f"{self._heartbeat_s:g})"
        )
      for index, peer in self._peers.items():
        if not peer.done and now - peer.seen_at > self._heartbeat_s:
          self._end(
            f"process {index}{self._host(index)} was lost: no heartbeat for {now - peer.seen_at:.0f} s "
            f"(faults.heartbeat_timeout_s={self._heartbeat_s:g})"
          )
      clock, pause = self._step_clock, self._pause
      if pause is not None and pause.limit_s and now - pause.since > pause.limit_s:
        self._end(f"{pause.what} did not end in {now - pause.since:.0f} s ({pause.setting})")
      if self._step_timeout_s and clock is not None and now - clock > self._step_timeout_s:
        # A peer that waits in the same collective beats at this step; one that stalls fell behind or fell silent.
        silent_s = 2 * self._heartbeat_s / _BEATS_PER_TIMEOUT
        late = [
          f"{i}{self._host(i)}, last heard from at step {p.step}"
          for i, p in self._peers.items()
          if p.step < self.step or now - p.seen_at > silent_s
        ]
        missing = f"; processes that did not arrive: {', '.join(late)}" if late else ""
        self._end(
          f"train step {self.step + 1} did not complete in {now - clock:.0f} s (faults.step_timeout_s="
          f"{self._step_timeout_s:g}){missing}"
        )

  def _host(self, index: int) -> str:
    host = self._peers[index].host if index in self._peers else socket.gethostname()
    return f" (host {host})" if host else ""

  def _end(self, what: str) -> None:
    if self._closed.is_set():
      return
    self._closed.set()
    _restart(f"process {self._index}", what, f"The run reached step {self.step}", self._checkpoint_dir)
    _patiently(self._before_exit)
    self._exit(RESTART_STATUS)


@contextlib.contextmanager
def joining(
  faults: ml_collections.ConfigDict,
  checkpoint_dir: str,
  index: int | None,
  *,
  exit_: Callable[[int], None] = os._exit,
) -> Iterator[None]:
  """Around joining the job (`jax.distributed.initialize`): processes that have not all joined within
  `faults.initialization_timeout_s` end this one with the line and the restart status (JAX's own timeout,
  `_JAX_BACKSTOP_S` later, aborts the process with a C++ dump).

  Args:
    index: this process's index where known before joining (else it is named by its host).
  """
  joined = threading.Event()
  timeout_s = float(faults.initialization_timeout_s)

  def watch() -> None:
    if not joined.wait(timeout_s):
      who = f"process {index}" if index is not None else f"the process on host {socket.gethostname()}"
      what = (
        f"the job's processes did not all join within {timeout_s:g} s (faults.initialization_timeout_s): one did "
        "not start, stalls, or cannot reach the coordinator"
      )
      _restart(who, what, "Nothing was trained in this start", checkpoint_dir)
      exit_(RESTART_STATUS)

  threading.Thread(target=watch, name="refusion-fault-join", daemon=True).start()
  try:
    yield
  finally:
    joined.set()


def _restart(who: str, what: str, reached: str, checkpoint_dir: str) -> None:
  """Print the line of a fault (`who`: what happened; how far the run got and where a restart resumes) and mark
  the restart for launch/restarting.sh; the caller exits with `RESTART_STATUS`."""
  print(
    f"\nrefusion_jax: {who}: {what}. {reached}; a restart resumes from {_resume_point(checkpoint_dir)}. Exiting "
    f"with status {RESTART_STATUS} (restart the job).",
    file=sys.stderr,
    flush=True,
  )
  if marker := os.environ.get("REFUSION_RESTART_MARKER"):  # launch/restarting.sh under srun: "restart"
    _patiently(lambda: open(marker, "a").close())
  sys.stdout.flush()


def _client():
  """The key-value store of `jax.distributed` (its client is not public API; orbax reads it the same way)."""
  from jax._src import distributed

  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("A multi-process run needs jax.distributed.initialize first (REFUSION_DISTRIBUTED=1).")
  return client


def _patiently(action: Callable[[], None]) -> bool:
  """Run a filesystem `action` in a helper thread for at most `_LIST_PATIENCE_S` (a filesystem that does not
  answer must not keep the process from exiting); returns whether it ended. An error counts as ended: the
  process is on its way out, and its line says what matters."""

  def run() -> None:
    with contextlib.suppress(Exception):
      action()

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  thread.join(_LIST_PATIENCE_S)
  return not thread.is_alive()


def _resume_point(directory: str) -> str:
  """Where a restart resumes: the newest complete checkpoint step (orbax names unfinished saves otherwise)."""
  found: list[int] = []
  listed = _patiently(lambda: found.extend(int(name) for name in os.listdir(directory) if name.isdigit()))
  if not listed:
    return f"the newest checkpoint in {directory} (the directory did not answer within {_LIST_PATIENCE_S:g} s)"
  if not found:
    return "the start (no checkpoint was complete)"
  return f"checkpoint step {max(found)} in {directory}"
