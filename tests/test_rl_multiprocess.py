"""GRPO in a multi-process run (docs/rl.md §5, "Several processes"): two processes of two CPU devices each start
from a checkpoint (`config.init_from`, each process reading its own shards), train, checkpoint and resume as one
process over the same four-device mesh does."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers.train_utils import REPO, load_config

from refusion_jax.checkpoints.export import write_refusion
from refusion_jax.data.tokenizer import load_tokenizer
from refusion_jax.evaluation.curve import read_scalars
from refusion_jax.model.transformer import init_model
from refusion_jax.training import inputs
from refusion_jax.training.run_config import model_config_from

# configs/grpo_demo.py:smoke for the AR policy, its parameters sharded across the processes (fsdp=2 of a data 2 x
# fsdp 2 mesh), with updates large enough to move the policy: two per rollout at a learning rate of 1e-2 from the
# first step, so that the second update's ratio leaves 1, and the clip and the KL act.
FLAGS = (
  "--config.objective.kind=ar",  # the cheapest rollout to compile; a multi-process run decodes ReFusion the same way
  "--config.mesh.fsdp=2",
  "--config.optimizer.lr=0.01",
  "--config.optimizer.warmup_steps=0",
  "--config.grpo.num_iterations=2",
  "--config.grpo.epsilon_high=0.28",
  "--config.checkpoint.max_to_keep=3",  # every step's checkpoint kept: the resume test starts from step 1's
)
# The step metrics that say what the run did (the seconds are the host's).
COMPARED = ("reward_mean", "reward_std", "accuracy", "rollout_forwards", "rollout_tpf")
COMPARED_CLOSE = ("loss", "pg_loss", "kl", "grad_norm", "ratio_mean", "ratio_max", "clip_fraction")


def _two_processes(workdir, data_dir: str, init_from: str) -> subprocess.Popen:
  """launch/local_multiprocess.sh: two processes of two CPU devices each (a compilation cache in the workdir)."""
  command = ["bash", "launch/local_multiprocess.sh", "2", "2", "configs/grpo_demo.py:smoke", str(workdir)]
  command += [f"--config.data.data_dir={data_dir}", f"--config.init_from={init_from}", *FLAGS]
  cache = dict(JAX_COMPILATION_CACHE_DIR=str(workdir / "cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  env = dict(os.environ, PYTHONPATH=REPO, **cache)
  return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _one_process(workdir, data_dir: str, init_from: str) -> subprocess.Popen:
  """The same run in one process of four CPU devices (the same mesh shape)."""
  command = [sys.executable, "-m", "refusion_jax.train", "--config", "configs/grpo_demo.py:smoke"]
  command += ["--workdir", str(workdir), f"--config.data.data_dir={data_dir}", f"--config.init_from={init_from}"]
  command += FLAGS
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
  return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(process: subprocess.Popen, workdir) -> None:
  """Wait for the run; what it printed is kept in workdir/output.log (two processes log to process_<i>.log)."""
  output = process.communicate(timeout=600)[0]
  (workdir / "output.log").write_text(output)
  logs = {path.name: path.read_text()[-3000:] for path in workdir.glob("process_*.log")}
  assert process.returncode == 0, (output[-3000:], logs)


def _assert_same_steps(two: dict, one: dict, steps: list[int]) -> None:
  """The step metrics TensorBoard holds for `steps` agree: the rollouts' bit for bit, the update's to rounding."""
  assert sorted(two["train/loss"]) == steps
  for step in steps:
    # The same prompts, seeds and weights: the same answers.
    for name in COMPARED:
      assert two[f"train/{name}"][step] == one[f"train/{name}"][step], (step, name)
    # The update's sums over devices of other processes may add in another order (float32 rounding); the losses'
    # advantage-weighted terms cancel to near 0, so their rounding is absolute (relative to the terms, ~1).
    for name in COMPARED_CLOSE:
      assert two[f"train/{name}"][step] == pytest.approx(one[f"train/{name}"][step], rel=1e-5, abs=1e-6), (step, name)


@pytest.fixture(scope="module")
def init_from(tmp_path_factory) -> str:
  """A run directory of the policy's model with weights of another seed than the config's: where the runs start
  (and, resumed, what they reload as the reference policy)."""
  config = load_config("grpo_demo")
  model_config = model_config_from(config, load_tokenizer(config.tokenizer))
  directory = str(tmp_path_factory.mktemp("start") / "sft")
  write_refusion(init_model(model_config, seed=config.seed + 1), directory, step=1, tokenizer=config.tokenizer)
  return directory


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir, init_from):
  """The 3-step run in two processes and in one, side by side: (the two's workdir, the one's workdir)."""
  root = tmp_path_factory.mktemp("runs")
  config = load_config("grpo_demo")
  config.data.data_dir = data_dir
  inputs.open_splits(config, str(root))  # the data, built before the two runs read it at once
  two, one = root / "two", root / "one"
  two.mkdir()
  started = [(_two_processes(two, data_dir, init_from), two), (_one_process(one, data_dir, init_from), one)]
  for process, workdir in started:
    _finish(process, workdir)
  return two, one


def test_two_processes_started_from_a_checkpoint_log_the_one_process_steps(runs, init_from):
  two, one = runs
  # Both started from the checkpoint, each process of the two reading its own shards of it.
  for log in (two / "process_0.log", one / "output.log"):
    assert f"Started from the parameters of {init_from}." in log.read_text()
  logged_one = read_scalars(str(one))
  assert sorted(logged_one["train/loss"]) == [1, 2, 3]
  assert max(logged_one["train/kl"].values()) > 0  # the policy moved: the updates compared are not trivial
  _assert_same_steps(read_scalars(str(two)), logged_one, [1, 2, 3])
  # Each process checkpointed the one-process run's data position (each reads the whole global batch).
  for step in (1, 2, 3):
    positions = [json.loads((two / f"checkpoints/{step}/data/process_{i}-of-2.json").read_text()) for i in range(2)]
    assert positions == [json.loads((one / f"checkpoints/{step}/data/process_0-of-1.json").read_text())] * 2


@pytest.mark.slow  # a third run, of two processes (~30 s of CPU)
def test_a_resumed_two_process_run_goes_on_as_the_uninterrupted_one(runs, tmp_path, data_dir, init_from):
  two, one = runs
  resumed = tmp_path / "resumed"
  # The two-process run's workdir as it was after step 1 (its compilation cache kept).
  later = lambda directory, names: [
    n for n in names if n == "tensorboard" or (os.path.basename(directory) == "checkpoints" and n in ("2", "3"))
  ]
  shutil.copytree(two, resumed, ignore=later)
  _finish(_two_processes(resumed, data_dir, init_from), resumed)  # the reference policy read again from init_from
  assert "Resumed from" in (resumed / "process_0.log").read_text()
  _assert_same_steps(read_scalars(str(resumed)), read_scalars(str(one)), [2, 3])
