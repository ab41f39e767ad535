"""What `GET /metrics` shows, in Prometheus's text format (version 0.0.4).

Counters grow for the server's life (requests by endpoint and status, prompt
and answer tokens, forwards, loop calls and seconds); gauges are read when
scraped (queue depth, rows busy, compilations of the decode loop since the
warm-up and in all, as `refusion_jax.decoding.compilations` counts them).
Tokens per forward is a gauge over the counters: answer tokens / forwards.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "refusion"

# name -> help text of every counter.
COUNTERS = {
  "prompt_tokens_total": "Prompt tokens of the requests admitted into a row.",
  "answer_tokens_total": "Answer tokens returned.",
  "forwards_total": "Model forwards of the answered requests' rows (prefills included).",
  "loop_calls_total": "Calls of the compiled decode loop.",
  "loop_seconds_total": "Seconds spent in decode loop calls (their read-back included).",
}


def _escape(value: str) -> str:
  return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
  """The server's counters (thread-safe) and the gauges it reads when scraped."""

  def __init__(self, gauges: dict[str, tuple[str, Callable[[], float]]]):
    """
    Args:
      gauges: name -> (help text, a function giving its value now).
    """
    self._lock = threading.Lock()
    self._counters: collections.Counter[str] = collections.Counter()
    self._requests: collections.Counter[tuple[str, int]] = collections.Counter()
    self._gauges = gauges

  def add(self, name: str, amount: float) -> None:
    """Add `amount` to the counter `name` (one of COUNTERS)."""
    if name not in COUNTERS:
      raise KeyError(f"unknown counter {name!r}; the counters are {sorted(COUNTERS)}.")
    with self._lock:
      self._counters[name] += amount

  def count_request(self, endpoint: str, status: int) -> None:
    with self._lock:
      self._requests[endpoint, status] += 1

  def value(self, name: str) -> float:
    with self._lock:
      return self._counters[name]

  def render(self) -> str:
    """Every metric in Prometheus's text format."""
    with self._lock:
      counters, requests = dict(self._counters), dict(self._requests)
    lines = [
      f"# HELP {PREFIX}_requests_total Requests answered, by endpoint and HTTP status.",
      f"# TYPE {PREFIX}_requests_total counter",
    ]
    for (endpoint, status), count in sorted(requests.items()):
      lines.append(f'{PREFIX}_requests_total{{endpoint="{_escape(endpoint)}",status="{status}"}} {count}')
    for name, help_text in COUNTERS.items():
      lines += [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} counter"]
      lines.append(f"{PREFIX}_{name} {counters.get(name, 0)}")
    forwards = counters.get("forwards_total", 0)
    tpf = counters.get("answer_tokens_total", 0) / forwards if forwards else 0.0
    gauges = {"tokens_per_forward": ("Answer tokens per forward over the answered requests.", lambda: tpf)}
    for name, (help_text, read) in {**gauges, **self._gauges}.items():
      lines += [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} gauge", f"{PREFIX}_{name} {read()}"]
    return "\n".join(lines) + "\n"
