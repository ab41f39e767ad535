"""SIGTERM / SIGINT that end a run within seconds, whatever it is doing.

A Python signal handler runs only in the main thread, between bytecodes: it
cannot run while the main thread is inside native code (XLA compiling, a
device computation, a multi-host barrier), and a handler that merely sets a
flag is never read by a loop blocked waiting for data. So a run declares what
its main thread is doing (`Interrupts.phase`), and the first signal acts by
phase:

- a *blocking* phase (building or waiting for data, loading, restoring,
  evaluating): the handler raises `StopRequested` in the main thread, which
  unblocks any Python-level wait at once; the loop then saves if it has a
  consistent state not yet saved, else stops with `RunInterrupted`;
- any other phase (a train step, a save, bookkeeping): the handler sets
  `requested`, and the loop stops at the step boundary, after saving.

A watchdog thread, woken through `signal.set_wakeup_fd` the moment a signal
arrives (even while the main thread is in native code), then gives every phase
`grace_s` seconds (plus the phase's own patience) to end: a main thread that
stays longer in one phase (stuck in a compilation, a computation, a barrier)
makes the process exit with status 128 + signal, saying where it was stuck.
A second signal exits at once, the same way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from types import FrameType

from absl import logging

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# The byte `close` sends the watchdog (no signal has number 0).
_STOP = 0


class StopRequested(Exception):
  """Raised in the main thread by a signal that arrived while it was blocked."""

  def __init__(self, signum: int, phase: str):
    super().__init__(f"{signal.Signals(signum).name} while {phase}")
    self.signum = signum
    self.phase = phase


class RunInterrupted(RuntimeError):
  """A signal stopped the run before it had anything new to save."""


def _signal_name(signum: int) -> str:
  return signal.Signals(signum).name


class Interrupts:
  """Installs the SIGTERM / SIGINT handlers and the watchdog; `close` restores the previous ones."""

  def __init__(self, grace_s: float = 10.0):
    """
    Args:
      grace_s: after a signal, the seconds each phase has to end (besides its own patience) before the
        process exits.
    """
    self.grace_s = grace_s
    self.requested: int | None = None  # the first signal received
    self._phase, self._blocking, self._patience_s = "starting", True, 0.0
    self._phase_changed = threading.Event()
    self._closed = False
    self._previous: dict[int, object] = {}
    self._previous_wakeup_fd = -1
    self._reader = self._writer = None
    self._watchdog: threading.Thread | None = None
    if threading.current_thread() is not threading.main_thread():
      logging.warning("Not in the main thread: SIGTERM / SIGINT will not stop the run cleanly.")
      return
    self._reader, self._writer = socket.socketpair()
    self._writer.setblocking(False)
    self._previous_wakeup_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
    for signum in SIGNALS:
      self._previous[signum] = signal.signal(signum, self._handle)
    self._watchdog = threading.Thread(target=self._watch, name="refusion-signal-watchdog", daemon=True)
    self._watchdog.start()

  @contextlib.contextmanager
  def phase(self, name: str, *, blocking: bool, patience_s: float = 0.0) -> Iterator[None]:
    """Declare what the main thread does inside the block (see the module docstring).

    Args:
      name: said in messages, e.g. "waiting for data".
      blocking: a signal raises `StopRequested` inside the block.
      patience_s: extra seconds the watchdog waits for this phase (e.g. a
        train step known to take that long).
    """
    saved = self._phase, self._blocking, self._patience_s
    self._enter(name, blocking, patience_s)
    try:
      if blocking and self.requested is not None:  # a signal that came before the block started
        raise StopRequested(self.requested, name)
      yield
    finally:
      self._enter(*saved)

  def _enter(self, name: str, blocking: bool, patience_s: float) -> None:
    self._phase, self._blocking, self._patience_s = name, blocking, patience_s
    self._phase_changed.set()

  def _handle(self, signum: int, frame: FrameType | None) -> None:
    del frame
    if self.requested is not None:
      self._exit_now(signum, "a second signal")
    self.requested = signum
    logging.warning("%s received while %s: stopping.", _signal_name(signum), self._phase)
    if self._blocking:
      raise StopRequested(signum, self._phase)

  def _watch(self) -> None:
    received = 0
    try:
      while True:
        for signum in self._reader.recv(64):
          if signum == _STOP or self._closed:
            return
          if signum not in SIGNALS:
            continue
          received += 1
          if received > 1:
            self._exit_now(signum, "a second signal")
          threading.Thread(target=self._time_phases, args=(signum,), daemon=True).start()
    finally:
      # Closed here, after the last read: closed by `close` instead, their descriptors could be reused by a new
      # socket that this thread, already on its way into recv, would then read.
      self._reader.close()
      self._writer.close()

  def _time_phases(self, signum: int) -> None:
    """After a signal: exit when the main thread stays in one phase past its time."""
    while not self._closed:
      self._phase_changed.clear()
      limit = self.grace_s + self._patience_s
      if not self._phase_changed.wait(limit) and not self._closed:
        self._exit_now(signum, f"{self._phase} went on for more than {limit:.0f} s after the signal")

  def _exit_now(self, signum: int, reason: str) -> None:
    print(
      f"\nrefusion_jax: exiting at once on {_signal_name(signum)} ({reason}); nothing more is saved. "
      "Checkpoints written before are intact: rerun the same command to resume from the last one.",
      file=sys.stderr,
      flush=True,
    )
    sys.stdout.flush()
    os._exit(128 + signum)

  def close(self) -> None:
    """Restore the previous handlers and stop the watchdog."""
    if self._watchdog is None:
      return
    self._closed = True
    self._phase_changed.set()
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    signal.set_wakeup_fd(self._previous_wakeup_fd)
    self._writer.send(bytes([_STOP]))
    self._watchdog.join()
    self._watchdog = None
