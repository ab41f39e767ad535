"""One log line per request: its id, endpoint, status and timings, on the `refusion_jax.serving` logger.

    request id=cmpl-3f2a… endpoint=/v1/completions status=200 prompt_tokens=12 answer_tokens=40
      finish=stop queue_s=0.004 first_text_s=0.051 decode_s=0.210 total_s=0.215

The prompt and answer texts are never logged (they may be private); the
metrics (`serving.metrics`) count the same request once.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("refusion_jax.serving")


def format_fields(fields: dict[str, Any]) -> str:
  """`key=value` pairs, floats to the millisecond, strings with spaces quoted."""

  def show(value: Any) -> str:
    if isinstance(value, float):
      return f"{value:.3f}"
    text = str(value)
    return repr(text) if any(c.isspace() for c in text) else text

  return " ".join(f"{key}={show(value)}" for key, value in fields.items() if value is not None)


def log_request(request_id: str, endpoint: str, status: int, **fields: Any) -> None:
  """Log one answered (or refused) request."""
  level = logging.WARNING if status >= 500 else logging.INFO
  logger.log(level, "request %s", format_fields(dict(id=request_id, endpoint=endpoint, status=status, **fields)))
