"""Compilations as JAX reports them: every executable built, the decode loop's counted per method.

A count of traces misses compiles a user pays for: JAX compiles a traced
program again when only the placement of an argument changed (committed to a
device vs not), without tracing it again. So this counts JAX's own backend
compile events (public `jax.monitoring`), each the build of one XLA
executable, whatever caused it. `loop.Loop` tags its loop calls (`tagged`),
so `loop.compile_count("refusion")` counts the compiles of ReFusion's loop,
and `compilations()` every compile in the process.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator

import jax

# Recorded around each XLA backend compile (`jax._src.dispatch.BACKEND_COMPILE_EVENT`, a long-standing name);
# a hit in the persistent compilation cache passes through it too, and is counted.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_COUNTS: collections.Counter[str | None] = collections.Counter()
_TAG = threading.local()


def _on_duration(event: str, duration: float, **metadata) -> None:
  del duration, metadata
  if event == BACKEND_COMPILE_EVENT:
    _COUNTS[None] += 1
    for tag in getattr(_TAG, "names", ()):
      _COUNTS[tag] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def compilations(tag: str | None = None) -> int:
  """XLA executables built in this process so far: all of them, or those built while `tagged(tag)`."""
  return _COUNTS[tag]


@contextlib.contextmanager
def tagged(*tags: str) -> Iterator[None]:
  """Count the compiles of this thread inside the block under each of `tags` too (see `compilations`)."""
  outer = getattr(_TAG, "names", ())
  _TAG.names = (*outer, *tags)
  try:
    yield
  finally:
    _TAG.names = outer
