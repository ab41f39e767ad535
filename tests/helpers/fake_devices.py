"""Run a script on 8 fake CPU devices in a subprocess (the device count must be set before JAX initialises)."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_json(script: str, *args: str, timeout: int = 600) -> dict:
  """Run `script` (which sets XLA_FLAGS itself) with `args`; return the JSON object on its last stdout line."""
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  out = subprocess.run(
    [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])
