"""The one timer of every benchmark, and the machine its tables name.

`time_rounds` calls each compared variant once to warm up (compilation is
excluded from every timing), then `repeats` rounds that call every variant
once in turn, so that a shared machine's slow spells fall on all alike. Each
variant reports the median of its rounds and their spread; a ratio between
two variants is the median of same-round ratios, steadier than a ratio of
medians. `--repeats` means these rounds in every bench, and in `eval`.
A call's time includes waiting for what it returns (`jax.block_until_ready`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Literal, TypeVar

import jax

from refusion_jax.decoding.compilations import compilations

Key = TypeVar("Key", bound=Hashable)
Result = TypeVar("Result")


@dataclasses.dataclass(frozen=True)
class Timing:
  """One variant's timed rounds (seconds, in round order) and its warm-up call (compilation and a run)."""

  rounds: tuple[float, ...]
  warm_up: float = 0.0

  @property
  def median(self) -> float:
    return statistics.median(self.rounds)

  @property
  def spread(self) -> float:
    """(slowest - fastest) / median of the rounds: 0 for one round."""
    return (max(self.rounds) - min(self.rounds)) / self.median if self.median > 0 else 0.0

  @property
  def compile_seconds(self) -> float:
    """The warm-up less one median run: what compiling took."""
    return max(self.warm_up - self.median, 0.0)

  def ratio_to(self, other: Timing) -> float:
    """The median over rounds of this variant's time / `other`'s in the same round."""
    return statistics.median(mine / theirs for mine, theirs in zip(self.rounds, other.rounds))


def time_rounds(
  calls: Mapping[Key, Callable[[], Result]],
  repeats: int,
  *,
  warm_up: Literal["always", "if_compiled"] = "always",
  progress: bool = True,
) -> tuple[dict[Key, Result], dict[Key, Timing]]:
  """Each variant's last result and its `Timing`: a warm-up call each, then `repeats` interleaved rounds.

  warm_up: "always" (every variant's first call is the warm-up) or "if_compiled" (a first call that compiled
    no XLA program, `decoding.compilations`, ran what the rounds run and counts as the first round: for one
    variant timed again and again, as eval's runner times its batches).
  progress: a line on stderr per warm-up and per round.
  """
  say = log if progress else lambda message: None
  if repeats < 1:
    raise ValueError(f"repeats={repeats} must be at least 1 (the timed rounds after the warm-up).")
  if warm_up not in ("always", "if_compiled"):
    raise ValueError(f"warm_up={warm_up!r}: choose 'always' or 'if_compiled'.")
  results: dict[Key, Result] = {}
  rounds: dict[Key, list[float]] = {}
  warm: dict[Key, float] = {}
  for key, call in calls.items():
    before = compilations() if warm_up == "if_compiled" else None
    results[key], seconds = _timed(call)
    if before is not None and compilations() == before:
      rounds[key] = [seconds]
    else:
      warm[key], rounds[key] = seconds, []
      say(f"{key}: warm-up (compile and run) {seconds:.2f}s")
  for round_ in range(repeats):
    for key, call in calls.items():
      if len(rounds[key]) < repeats:  # a first call that compiled nothing was this variant's first round
        results[key], seconds = _timed(call)
        rounds[key].append(seconds)
    say(f"timed round {round_ + 1} of {repeats}")
  return results, {key: Timing(tuple(rounds[key]), warm.get(key, 0.0)) for key in calls}


def _timed(call: Callable[[], Result]) -> tuple[Result, float]:
  start = time.perf_counter()
  result = jax.block_until_ready(call())
  return result, time.perf_counter() - start


@functools.cache
def machine() -> str:
  """What ran the timings, for every table: the accelerators (count x kind), else the CPU's model and cores."""
  device = jax.devices()[0]
  if device.platform != "cpu":
    return f"{jax.device_count()} x {device.device_kind} ({device.platform})"
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return f"CPU {_cpu_model()}, {cores} cores"


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as info:
      for line in info:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:  # not Linux
    pass
  return platform.processor() or platform.machine()


def log(message: str) -> None:
  """A progress line on stderr (the report goes to stdout)."""
  print(f"[bench] {message}", file=sys.stderr, flush=True)
