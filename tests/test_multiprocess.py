"""A real multi-process run: launch/local_multiprocess.sh joins two processes with jax.distributed."""

import os
import re
import subprocess

from helpers.train_utils import REPO


def test_two_processes_build_data_train_evaluate_and_checkpoint_together(tmp_path):
  workdir = tmp_path / "run"
  command = [
    "bash",
    "launch/local_multiprocess.sh",
    "2",
    "2",
    "configs/demo.py:smoke",
    str(workdir),
    "--config.mesh.fsdp=2",  # parameters sharded across the two processes' devices
  ]
  result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
  logs = {i: (workdir / f"process_{i}.log").read_text() for i in range(2)}
  assert result.returncode == 0, logs
  for log in logs.values():
    assert "Traceback" not in log
  assert (workdir / "data").is_dir()  # built by process 0 while process 1 waited, then read by both
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
  evals = re.findall(r"\[eval\] step (\d+): .*exact_match=", logs[0])
  assert evals == ["2", "4"]  # decoding ran with the parameters sharded over both processes
  assert "Validation exact match" in logs[0]
