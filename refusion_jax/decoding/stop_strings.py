"""Stop strings: where an answer's text ends, decided the same way on a growing text and on the whole of it.

An answer stops at the earliest position where any stop string begins (the
stop string itself is not part of the answer), as OpenAI's `stop` does. While
the text still grows, a stop string may be only partly there: the tail that
is a proper prefix of some stop string is held back (`pending_from`) until
more text settles it. Cutting a growing text this way never sends a character
that the whole text's cut would drop (`docs/serving.md`, "Streaming").
"""

from __future__ import annotations

from collections.abc import Sequence

# OpenAI's limit on `stop` is 4 strings; lm-eval sends a task's whole `until` list plus the EOS, so callers may
# allow more (the server's --max_stop). The length bound keeps every check of a growing answer cheap.
MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 256


def check_stop_strings(stops: str | Sequence[str] | None, limit: int = MAX_STOP_STRINGS) -> tuple[str, ...]:
  """`stops` as a tuple of non-empty strings (None or one string accepted).

  Args:
    limit: the most strings allowed.

  Raises:
    ValueError: more than `limit`, an empty one, or one longer than MAX_STOP_LENGTH characters.
  """
  if stops is None:
    return ()
  stops = (stops,) if isinstance(stops, str) else tuple(stops)
  if len(stops) > limit:
    raise ValueError(f"stop has {len(stops)} strings; give at most {limit}.")
  for stop in stops:
    if not isinstance(stop, str) or not stop:
      raise ValueError(f"stop strings must be non-empty strings; got {stop!r}.")
    if len(stop) > MAX_STOP_LENGTH:
      raise ValueError(f"a stop string has {len(stop)} characters; give at most {MAX_STOP_LENGTH}.")
  return stops


def first_stop(text: str, stops: Sequence[str]) -> int | None:
  """The earliest index in `text` where one of `stops` begins, None if none occurs."""
  found = [at for at in (text.find(stop) for stop in stops) if at >= 0]
  return min(found) if found else None


def pending_from(text: str, stops: Sequence[str]) -> int:
  """The earliest index p such that text[p:] is a non-empty proper prefix of a stop string (len(text) if none):
  from there on, more text could still complete a stop string."""
  longest = max((len(stop) - 1 for stop in stops), default=0)
  for at in range(max(0, len(text) - longest), len(text)):
    tail = text[at:]
    if any(stop.startswith(tail) and stop != tail for stop in stops):
      return at
  return len(text)


def settled_cut(text: str, stops: Sequence[str], final: bool) -> tuple[int, bool]:
  """How much of `text` is settled, and whether a stop string ended it.

  Args:
    text: the answer's text so far (never to change; it may grow if not `final`).
    final: nothing will be appended to `text`.

  Returns:
    (end, stopped): text[:end] is a prefix of the answer whatever is appended later; `stopped` when the
    answer ends at `end` because a stop string begins there (then nothing after it matters).
  """
  cut = first_stop(text, stops)
  if final:
    return (len(text), False) if cut is None else (cut, True)
  pending = pending_from(text, stops)
  if cut is not None and cut <= pending:
    return cut, True
  return pending, False
