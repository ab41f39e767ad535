"""`python -m refusion_jax.serve` in a child process on a free port of 127.0.0.1, which the server tests talk to
as any client would (tests/test_serving.py).

    server = start(["--random_init", "tiny", "--tokenizer", "bytes"], "server.log")
    httpx.get(server.url + "/health")
    server.terminate(60)  # SIGTERM; the exit status
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

HOST = "127.0.0.1"


def free_port() -> int:
  """A TCP port of 127.0.0.1 that nothing listens on now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
    probe.bind((HOST, 0))
    return probe.getsockname()[1]


@dataclasses.dataclass
class Server:
  """A running server: its process, its base URL, and where its output goes."""

  process: subprocess.Popen
  url: str
  log_path: str

  def log(self) -> str:
    with open(self.log_path, encoding="utf-8", errors="replace") as f:
      return f.read()

  def terminate(self, timeout: float) -> int:
    """SIGTERM, then wait at most `timeout` seconds for the exit status (killed past it: -9)."""
    if self.process.poll() is None:
      self.process.send_signal(signal.SIGTERM)
    try:
      return self.process.wait(timeout)
    except subprocess.TimeoutExpired:
      self.process.kill()
      self.process.wait()
      return -9


def start(args: Sequence[str], log_path: str, ready_seconds: float = 600.0, env: dict | None = None) -> Server:
  """Start `python -m refusion_jax.serve ARGS --port <free>` and wait until /health answers.

  Raises:
    RuntimeError: the server exited or was not ready within `ready_seconds` (its output in the message).
  """
  port = free_port()
  command = [sys.executable, "-m", "refusion_jax.serve", *args, "--host", HOST, "--port", str(port)]
  log = open(log_path, "w", encoding="utf-8")  # the child writes it for its whole life
  process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
  server = Server(process, f"http://{HOST}:{port}", log_path)
  deadline = time.monotonic() + ready_seconds
  while time.monotonic() < deadline:
    if process.poll() is not None:
      raise RuntimeError(f"the server exited with status {process.returncode}:\n{server.log()[-4000:]}")
    try:
      with urllib.request.urlopen(server.url + "/health", timeout=2) as response:
        if response.status == 200:
          return server
    except (urllib.error.URLError, ConnectionError, TimeoutError):
      time.sleep(0.25)
  server.terminate(10)
  raise RuntimeError(f"the server was not ready in {ready_seconds:.0f} s:\n{server.log()[-4000:]}")
