"""Server-sent events as OpenAI streams them: one `data: <json>` event per chunk, then `data: [DONE]`."""

from __future__ import annotations

import json
from typing import Any

import pydantic

MEDIA_TYPE = "text/event-stream"
DONE = "data: [DONE]\n\n"


def event(chunk: pydantic.BaseModel | dict[str, Any]) -> str:
  """One event carrying `chunk` as compact JSON (unset optional fields left out, as OpenAI's are)."""
  data = chunk.model_dump(exclude_none=True) if isinstance(chunk, pydantic.BaseModel) else chunk
  return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"
