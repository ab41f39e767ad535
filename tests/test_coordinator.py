"""training/coordinator.py: process 0 starts the job's coordination service in a process of its own, which outlives
process 0 while clients are connected and exits once none is; every other process, and a one-process job, join as
JAX would have them."""

import json
import os
import socket
import subprocess
import sys
import time

from helpers.train_utils import REPO

from refusion_jax.training import coordinator


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_only_process_0_of_several_starts_a_service():
  address = f"127.0.0.1:{_free_port()}"
  assert coordinator.start_apart(coordinator_address=address, num_processes=2, process_id=1) == {}
  assert coordinator.start_apart(coordinator_address=address, num_processes=1, process_id=0) == {}
  assert not coordinator._answers(address)


# Process 0: starts the service, says what jax.distributed.initialize gets, holds a client connection to it (as
# JAX's would) for a moment, then exits without a word to it, as a killed process would.
_PROCESS_0 = """
import json, socket, sys, time
from refusion_jax.training import coordinator
address = sys.argv[1]
options = coordinator.start_apart(coordinator_address=address, num_processes=2, process_id=0,
                                  heartbeat_timeout_seconds=50, shutdown_timeout_seconds=5)
print(json.dumps(options), flush=True)
client = socket.create_connection(("127.0.0.1", int(address.rsplit(":", 1)[1])))
sys.stdin.readline()
"""


def test_the_service_outlives_process_0_while_a_client_is_connected_and_exits_after_the_last():
  port = _free_port()
  address = f"127.0.0.1:{port}"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  parent = subprocess.Popen(
    [sys.executable, "-c", _PROCESS_0, address], cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
  )
  options = json.loads(parent.stdout.readline())
  assert options == dict(
    coordinator_address=address, num_processes=2, process_id=0, coordinator_bind_address="127.0.0.1:0"
  )
  survivor = socket.create_connection(("127.0.0.1", port))  # another process's client
  parent.kill()  # process 0 and its connection gone
  parent.wait()
  time.sleep(1.0)  # five of the service's looks at its parent and clients
  assert coordinator._answers(address), "the service went with process 0"
  survivor.close()
  deadline = time.monotonic() + 10
  while coordinator._answers(address) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not coordinator._answers(address), "the service outlived its last client"
