"""Who may call the server: `Authorization: Bearer KEY` when the server has a key (`--api_key` or REFUSION_API_KEY).

The key is compared in constant time (`hmac.compare_digest`), so the time a
refusal takes says nothing about how much of a guess was right. Without a key
every endpoint is open, as on a machine that only binds 127.0.0.1.
"""

from __future__ import annotations

import hmac
import os

from refusion_jax.serving.errors import APIError

API_KEY_ENV = "REFUSION_API_KEY"


def server_key(flag: str | None) -> str | None:
  """The key the server requires: `--api_key`, else the environment's REFUSION_API_KEY, else None (open)."""
  key = flag if flag is not None else os.environ.get(API_KEY_ENV)
  if key is not None and not key.strip():
    raise ValueError(f"The API key is empty; give a non-empty --api_key or {API_KEY_ENV}, or neither (open server).")
  return key


def check_authorization(header: str | None, key: str | None) -> None:
  """Raise 401 unless `header` (the Authorization header) is `Bearer <key>` or the server has no key."""
  if key is None:
    return
  scheme, _, given = (header or "").partition(" ")
  if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
    raise APIError(
      401,
      "Missing or wrong API key: send the header 'Authorization: Bearer KEY' with the server's key.",
      code="invalid_api_key",
      headers={"WWW-Authenticate": "Bearer"},
    )
