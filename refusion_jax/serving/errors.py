"""Errors as OpenAI's API sends them: an HTTP status and `{"error": {"message", "type", "param", "code"}}`.

Every refusal of the server is an `APIError`; the app turns it into this body,
so a client library (the `openai` package) raises its own matching exception
with our message, which says what to change.
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
  """A request the server refuses or could not serve.

  Attributes:
    status: the HTTP status (400 bad request, 401 no key, 413 too large, 429 busy, 503 shutting down, 500).
    message: what was wrong and how to fix it.
    type: OpenAI's error type ("invalid_request_error", ...).
    param: the request field at fault, if one.
    code: a short machine-readable code, if any.
    headers: extra response headers (Retry-After, WWW-Authenticate).
  """

  def __init__(
    self,
    status: int,
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
  ):
    super().__init__(message)
    self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
    self.headers = headers or {}

  def body(self) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
  """400: the request cannot be served as sent."""
  return APIError(400, message, param=param, code=code)
