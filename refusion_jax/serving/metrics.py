"""What `GET /metrics` shows, in Prometheus's text format (version 0.0.4), in vLLM's vocabulary where it has a word.

Counters grow for the server's life (requests by route and status, prompt
and answer tokens, forwards, loop calls and seconds); histograms describe
each answered request as vLLM's do (time to first token, end-to-end
latency, queue time, inter-token latency); gauges are read when scraped
(requests running and waiting, rows, compilations of the decode loop since
the warm-up and in all, as `refusion_jax.decoding.compilations` counts them).
Tokens per forward is a gauge over the counters: answer tokens / forwards.

Every label value comes from a bounded set: requests are counted by their
route's template (`/v1/models/{model}`), never by the raw path, and a path no
route matches counts as `UNMATCHED`; so no client can grow the number of series
(docs/serving.md, "Health and metrics").
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
import threading
from collections.abc import Callable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "refusion"
# The route label of a request whose path no route of the server matches.
UNMATCHED = "unmatched"

# name -> help text of every counter.
COUNTERS = {
  "prompt_tokens_total": "Prompt tokens of the requests admitted into a row.",
  "answer_tokens_total": "Answer tokens returned.",
  "forwards_total": "Model forwards of the answered requests' rows (prefills included).",
  "loop_calls_total": "Calls of the compiled decode loop.",
  "loop_seconds_total": "Seconds spent in decode loop calls (their read-back included).",
}

# vLLM's bucket bounds (vllm/v1/metrics/loggers.py), so dashboards built for vLLM read ours.
_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_FIRST_TOKEN_BUCKETS += (20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
_REQUEST_BUCKETS += (480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_TOKEN_BUCKETS += (40.0, 80.0)

# name -> (help text, bucket upper bounds) of every histogram; one observation per answered request (per token
# for the inter-token latency).
HISTOGRAMS = {
  "time_to_first_token_seconds": (
    "From a request's arrival to its first answer token readable (the answer's first committed token).",
    _FIRST_TOKEN_BUCKETS,
  ),
  "e2e_request_latency_seconds": ("From a request's arrival to its answer's end.", _REQUEST_BUCKETS),
  "request_queue_time_seconds": (
    "From a request's arrival to its row's start: waiting for the engine and for a free row.",
    _REQUEST_BUCKETS,
  ),
  "inter_token_latency_seconds": (
    "Between two deliveries of a request's answer tokens, per token delivered (ReFusion commits several at once).",
    _TOKEN_BUCKETS,
  ),
}


def _escape(value: str) -> str:
  return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _bound(value: float) -> str:
  """A bucket's upper bound as Prometheus writes it."""
  return "+Inf" if value == math.inf else repr(float(value))


@dataclasses.dataclass
class Histogram:
  """Counts of observations at or below each bound (cumulative when rendered), their sum and count."""

  bounds: Sequence[float]
  counts: list[int] = dataclasses.field(default_factory=list)
  total: float = 0.0
  count: int = 0

  def __post_init__(self):
    self.counts = self.counts or [0] * (len(self.bounds) + 1)  # the last: above every bound

  def observe(self, value: float, count: int = 1) -> None:
    self.counts[bisect.bisect_left(self.bounds, value)] += count
    self.total += value * count
    self.count += count

  def lines(self, name: str) -> list[str]:
    lines, running = [], 0
    for bound, count in zip([*self.bounds, math.inf], self.counts):
      running += count
      lines.append(f'{name}_bucket{{le="{_bound(bound)}"}} {running}')
    return lines + [f"{name}_sum {self.total}", f"{name}_count {self.count}"]


class Metrics:
  """The server's counters and histograms (thread-safe) and the gauges it reads when scraped."""

  def __init__(self, gauges: dict[str, tuple[str, Callable[[], float]]]):
    """
    Args:
      gauges: name -> (help text, a function giving its value now).
    """
    self._lock = threading.Lock()
    self._counters: collections.Counter[str] = collections.Counter()
    self._requests: collections.Counter[tuple[str, int]] = collections.Counter()
    self._histograms = {name: Histogram(bounds) for name, (_, bounds) in HISTOGRAMS.items()}
    self._gauges = gauges

  def add(self, name: str, amount: float) -> None:
    """Add `amount` to the counter `name` (one of COUNTERS)."""
    if name not in COUNTERS:
      raise KeyError(f"unknown counter {name!r}; the counters are {sorted(COUNTERS)}.")
    with self._lock:
      self._counters[name] += amount

  def observe(self, name: str, seconds: float, count: int = 1) -> None:
    """Record `count` observations of `seconds` in the histogram `name` (one of HISTOGRAMS)."""
    if name not in HISTOGRAMS:
      raise KeyError(f"unknown histogram {name!r}; the histograms are {sorted(HISTOGRAMS)}.")
    with self._lock:
      self._histograms[name].observe(max(seconds, 0.0), count)

  def count_request(self, route: str, status: int) -> None:
    """Count one answered request of `route`: a route's template or UNMATCHED, never a raw path."""
    with self._lock:
      self._requests[route, status] += 1

  def value(self, name: str) -> float:
    with self._lock:
      return self._counters[name]

  def render(self) -> str:
    """Every metric in Prometheus's text format."""
    with self._lock:
      counters, requests = dict(self._counters), dict(self._requests)
      histograms = {name: dataclasses.replace(h, counts=list(h.counts)) for name, h in self._histograms.items()}
    lines = [
      f"# HELP {PREFIX}_requests_total Requests answered, by route (its template) and HTTP status.",
      f"# TYPE {PREFIX}_requests_total counter",
    ]
    for (route, status), count in sorted(requests.items()):
      lines.append(f'{PREFIX}_requests_total{{endpoint="{_escape(route)}",status="{status}"}} {count}')
    for name, help_text in COUNTERS.items():
      lines += [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} counter"]
      lines.append(f"{PREFIX}_{name} {counters.get(name, 0)}")
    for name, (help_text, _) in HISTOGRAMS.items():
      lines += [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} histogram"]
      lines += histograms[name].lines(f"{PREFIX}_{name}")
    forwards = counters.get("forwards_total", 0)
    tpf = counters.get("answer_tokens_total", 0) / forwards if forwards else 0.0
    gauges = {"tokens_per_forward": ("Answer tokens per forward over the answered requests.", lambda: tpf)}
    for name, (help_text, read) in {**gauges, **self._gauges}.items():
      lines += [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} gauge", f"{PREFIX}_{name} {read()}"]
    return "\n".join(lines) + "\n"
