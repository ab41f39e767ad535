"""What the benchmarks' reports share: a fixed-width text table opened by the machine that ran it, and byte counts."""

from __future__ import annotations

from collections.abc import Sequence

from refusion_jax.benchmarks.timer import Timing, machine


def table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
  """Fixed-width columns under a `machine:` line: the first two left-aligned (names), the others right-aligned."""
  widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
  fmt = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
  rule = "-" * len(fmt(header))
  return "\n".join([f"machine: {machine()}", fmt(header), rule, *map(fmt, lines)])


def byte_count(count: int | None) -> str:
  """`count` bytes in B, KiB, MiB or GiB; "-" for None."""
  if count is None:
    return "-"
  for unit in ("B", "KiB", "MiB", "GiB"):
    if count < 1024 or unit == "GiB":
      return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
    count /= 1024
  raise AssertionError("unreachable")


def spread(timing: Timing) -> str:
  """The cell of a timing's spread: its rounds' range over their median, in percent."""
  return f"{100 * timing.spread:.0f}%"
