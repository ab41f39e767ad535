"""The job's coordination service in a process of its own, so that the other processes outlive process 0.

`jax.distributed.initialize` runs the job's coordination service (its key-value store, barriers and heartbeat
checks) inside process 0. When that process dies (killed, out of memory), the service's sockets close with it and
JAX's client in every other process aborts that process within milliseconds: a C++ fatal error, exit status 134
and a stack dump, before `FaultWatch` (training/faults.py) can say what happened, and with a status no launcher
restarts on. jaxlib gives no hook (a Python `missed_heartbeat_callback` cannot receive the status and aborts too).

So process 0 of a training job starts the service in a small process of its own (this module run as a program:
jaxlib's service and nothing else), on the coordinator's address, and joins it as a client like every other
process; the service `jax.distributed` insists on starting inside process 0 is bound to a spare local port that
no process uses. A dead process 0 is then lost like any other: the service lives on, and FaultWatch ends the
others with its line and the restart status (docs/scaling.md, "When a host is lost or stalls").

The service process ignores SIGINT, SIGTERM and SIGHUP (the job's processes save a checkpoint on them, and need
the service to do so) and exits once process 0 has exited and no client is connected any more (read from
/proc/net/tcp), or `linger_s` after process 0 exited (a client that never lets go), whichever comes first; so a
restart finds the port free. It lives on process 0's host: a lost host takes it along, as before.

Where it cannot be used, process 0 runs the service itself, as `jax.distributed` does by default, and says so:
one process, an address JAX cannot work out before it initialises, mutual TLS configured for the service
(`jax_mtls_*`, which this process would not carry over), or a service process that did not come up.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

# How long process 0 waits for the service process to answer on its port (importing jaxlib takes ~1 s).
_START_PATIENCE_S = 60.0
# How often the service process looks at its parent and its clients.
_POLL_S = 0.2
# The port `jax.distributed` binds process 0's own (unused) service to: 0 lets the system pick a free one.
_SPARE_BIND_ADDRESS = "127.0.0.1:0"


def start_apart(**options: Any) -> dict[str, Any]:
  """On process 0 of a multi-process job: start the coordination service in a process of its own.

  Args:
    options: the arguments `jax.distributed.initialize` will get (num_processes, process_id, the timeouts:
      heartbeat_timeout_seconds, shutdown_timeout_seconds, initialization_timeout); those left unset are
      worked out as JAX would (its cluster detection: a TPU pod, SLURM).

  Returns:
    The arguments to add to `options`: on process 0, when the service runs apart, the coordinator's address, the
    process count and index, and a spare `coordinator_bind_address` for the service `jax.distributed` starts in
    process 0 anyway; else nothing (every other process joins the coordinator's address as usual).
  """
  where = _job(options)
  if where is None:
    return {}
  address, count, index = where
  if index != 0 or count < 2:
    return {}
  if _mutual_tls():
    _say("mutual TLS is configured for it (jax_mtls_*)")
    return {}
  linger_s = float(options.get("heartbeat_timeout_seconds", 100)) + 10
  _wait_until_free(address, linger_s)
  settings = dict(
    bind=os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", "[::]:" + address.rsplit(":", 1)[1]),
    processes=count,
    heartbeat_timeout_s=options.get("heartbeat_timeout_seconds"),
    shutdown_timeout_s=options.get("shutdown_timeout_seconds"),
    recoverable=_recoverable(),
    parent=os.getpid(),
    linger_s=linger_s,
  )
  service = subprocess.Popen(
    [sys.executable, "-m", __name__, json.dumps(settings)],
    stdin=subprocess.DEVNULL,
    stdout=subprocess.DEVNULL,
    start_new_session=True,  # a Ctrl-C or a signal to the launcher's process group leaves it to the others
  )
  deadline = time.monotonic() + _START_PATIENCE_S
  while not _answers(address):
    if service.poll() is not None or time.monotonic() > deadline:
      with contextlib.suppress(OSError):
        service.kill()
      _say(f"its process did not come up at {address}")
      return {}
    time.sleep(_POLL_S)
  return dict(
    coordinator_address=address, num_processes=count, process_id=0, coordinator_bind_address=_SPARE_BIND_ADDRESS
  )


def _job(options: dict[str, Any]) -> tuple[str, int, int] | None:
  """(coordinator address, process count, this process's index), given or as JAX's cluster detection finds them;
  None where they cannot be known before `jax.distributed.initialize` runs."""
  address = options.get("coordinator_address") or os.environ.get("JAX_COORDINATOR_ADDRESS")
  count, index = options.get("num_processes"), options.get("process_id")
  if None in (address, count, index):
    try:  # not public API: any change to it leaves the service in process 0, as JAX starts it
      from jax._src import clusters

      address, count, index, _ = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        address, count, index, None, None, options.get("initialization_timeout", 300)
      )
    except Exception as error:
      _say(f"JAX's cluster detection could not be asked for its address first: {error!r}")
      return None
  if None in (address, count, index) or ":" not in str(address):
    return None
  return str(address), int(count), int(index)


def _mutual_tls() -> bool:
  """Whether the service is to use mutual TLS (jax >= 0.12's `jax_mtls_*` options)."""
  import jax

  return any(getattr(jax.config, f"jax_mtls_{part}", None) for part in ("cert_file", "key_file", "ca_file"))


def _recoverable() -> bool:
  """`jax_enable_recoverability`, which JAX passes to the service it starts."""
  import jax

  return bool(getattr(jax.config, "jax_enable_recoverability", False))


def _say(why: str) -> None:
  print(
    f"refusion_jax: process 0 runs the job's coordination service itself ({why}): if process 0 dies, JAX "
    "aborts the other processes (status 134) before they can say so.",
    file=sys.stderr,
    flush=True,
  )


def _answers(address: str) -> bool:
  """Whether something accepts connections at `address` ("host:port")."""
  host, port = address.rsplit(":", 1)
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
      return True
  except OSError:
    return False


def _wait_until_free(address: str, patience_s: float) -> None:
  """Until nothing answers at `address`, at most `patience_s`: the service of a job that just ended (a restart
  comes at once) exits once its last client is gone, and two services on one port would share its clients."""
  deadline = time.monotonic() + patience_s
  while _answers(address) and time.monotonic() < deadline:
    time.sleep(_POLL_S)


# ------------------------------------------------------------------ the service process


def _clients(port: int) -> int | None:
  """Connections established to `port` on this host (/proc/net/tcp); None where that cannot be read."""
  count, read = 0, False
  for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
      with open(table) as rows:
        next(rows)
        for row in rows:
          local, _, state = row.split()[1:4]
          count += state == "01" and int(local.rsplit(":", 1)[1], 16) == port  # 01: ESTABLISHED
      read = True
    except (OSError, ValueError, IndexError, StopIteration):
      continue
  return count if read else None


def serve(settings: dict[str, Any]) -> None:
  """Run the service of `start_apart`'s `settings` until process 0 has exited and no client is left."""
  for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(signum, signal.SIG_IGN)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # as jax sets it: the service's INFO lines are noise
  from jaxlib import _jax

  options = dict(heartbeat_timeout=settings["heartbeat_timeout_s"], shutdown_timeout=settings["shutdown_timeout_s"])
  options = {name: int(value) for name, value in options.items() if value is not None}
  _service = _jax.get_distributed_runtime_service(  # serves while referenced
    settings["bind"], settings["processes"], recoverable=settings["recoverable"], **options
  )
  port, parent_gone = int(settings["bind"].rsplit(":", 1)[1]), None
  while parent_gone is None or not (_clients(port) == 0 or time.monotonic() - parent_gone > settings["linger_s"]):
    time.sleep(_POLL_S)
    if parent_gone is None and os.getppid() != settings["parent"]:
      parent_gone = time.monotonic()
  os._exit(0)  # no orderly shutdown: its clients are gone


if __name__ == "__main__":
  serve(json.loads(sys.argv[1]))
