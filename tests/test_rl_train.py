"""The GRPO trainer (refusion_jax.rl.trainer) in the training loop: what it logs, one compile for all steps, exact
resume after kill -9, SIGTERM, LoRA's reference, JSON prompts with their columns, bad data and rewards refused."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from flax import nnx
from helpers.fake_devices import run_json
from helpers.rl_utils import RecordingSteps, grpo_config
from helpers.train_utils import REPO

from refusion_jax.checkpoints.load import load
from refusion_jax.checkpoints.orbax import Checkpoints
from refusion_jax.data.pipeline import DataError
from refusion_jax.rl.rewards import RewardError
from refusion_jax.training.loop import train_and_evaluate

# What every step logs besides the loss (the list, by our names).
STEP_METRICS = {
  "reward_mean",
  "reward_std",
  "accuracy",
  "kl",
  "clip_fraction",
  "rollout_tpf",
  "rollout_forwards",
  "rollout_seconds",
  "update_seconds",
  "loss",
  "grad_norm",
}


def _params_of(workdir: str) -> dict:
  model, _ = load(workdir)
  return {path: np.asarray(v) for path, v in nnx.to_flat_state(nnx.state(model))}


def _flags(config) -> list[str]:
  """The command-line overrides that make configs/grpo_demo.py:smoke the test's config."""
  fields = dict(
    **{"data.data_dir": config.data.data_dir, "objective.kind": config.objective.kind},
    **{f"grpo.{k}": config.grpo[k] for k in ("num_iterations", "beta", "epsilon_high")},
    **{"grpo.rewards": repr(tuple(config.grpo.rewards))},
    **{"optimizer.lr": config.optimizer.lr, "num_train_steps": config.num_train_steps, "batch_size": config.batch_size},
  )
  return [f"--config.{k}={v}" for k, v in fields.items()]


def _start(workdir: str, config, **env_vars: str) -> subprocess.Popen:
  command = [sys.executable, "-m", "refusion_jax.train", "--config", "configs/grpo_demo.py:smoke"]
  command += ["--workdir", workdir, *_flags(config)]
  path = os.pathsep.join([REPO, os.path.join(REPO, "tests")])  # the rewards of helpers/rl_utils.py
  env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", PYTHONPATH=path, **env_vars)
  return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _run_until(
  process: subprocess.Popen, line_start: str, then: signal.Signals, checkpoint_dir: str | None = None
) -> str:
  """Read the process's output until a line starts with `line_start` (and, given `checkpoint_dir`, until it holds a
  finished checkpoint of that step), send `then`; return all it printed."""
  output = []
  try:
    for line in process.stdout:
      output.append(line)
      if line.startswith(line_start):
        step = int(line_start.split()[-1].rstrip(":"))
        while checkpoint_dir and not os.path.isdir(os.path.join(checkpoint_dir, str(step))):
          time.sleep(0.1)  # written in the background; the run stalls in the next step meanwhile
        process.send_signal(then)
        break
    output.append(process.communicate(timeout=120)[0])
  finally:
    process.kill()
  return "".join(output)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data_dir):
  """A 4-step AR GRPO run in one go, 4 prompts x 2 answers a step: (config, its recording steps, result, final
  parameters)."""
  config = grpo_config(data_dir, batch_size=4)
  steps = RecordingSteps(config)
  workdir = str(tmp_path_factory.mktemp("straight"))
  result = train_and_evaluate(config, workdir, steps)
  return config, steps, result, _params_of(workdir)


def test_every_step_logs_what_it_did_and_nothing_compiles_after_the_first(straight):
  _, steps, result, _ = straight
  assert result.step == 4 and sorted(result.losses) == [1, 2, 3, 4]
  for metrics in steps.metrics:
    assert STEP_METRICS <= set(metrics), STEP_METRICS - set(metrics)
    assert all(np.isfinite(v) for v in metrics.values())
    assert metrics["rollout_tpf"] == pytest.approx(1.0)  # AR: a token per forward
  # The rollout's decode loop, the reference's forward and the update compiled in step 1; nothing since.
  assert steps.compilations[1:] == [steps.compilations[0]] * 3, steps.compilations
  # The second update of each rollout is off-policy: the policy moved away from the start and the clip acts.
  assert max(m["kl"] for m in steps.metrics[1:]) > 0
  assert max(m["clip_fraction"] for m in steps.metrics) > 0


def test_resume_after_kill_9_is_exact(straight, tmp_path):
  config, straight_steps, _, straight_params = straight
  workdir = str(tmp_path / "killed")
  checkpoint_dir = os.path.join(workdir, "checkpoints")
  text = _run_until(_start(workdir, config, RL_TEST_STALL="1"), "[train] step 2:", signal.SIGKILL, checkpoint_dir)
  assert "[train] step 2:" in text, text[-3000:]
  with Checkpoints(checkpoint_dir) as checkpoints:
    saved = checkpoints.all_steps()
  assert max(saved) == 2, saved  # killed while step 3 stalled in its reward
  steps = RecordingSteps(config)
  resumed = train_and_evaluate(config, workdir, steps)
  first = max(saved) + 1
  assert sorted(resumed.losses) == list(range(first, 5))
  # The same rollouts, rewards and updates as the run that was never killed: bitwise on the CPU.
  assert steps.metrics[0]["reward_mean"] == straight_steps.metrics[first - 1]["reward_mean"]
  params = _params_of(workdir)
  for path, value in straight_params.items():
    np.testing.assert_array_equal(params[path], value, err_msg=str(path))


def test_sigterm_saves_the_step_and_exits_cleanly(straight, tmp_path):
  config = straight[0]
  workdir = str(tmp_path / "run")
  process = _start(workdir, config)
  text = _run_until(process, "[train] step 1:", signal.SIGTERM)
  assert process.returncode == 0, text[-3000:]
  stopped = re.search(r"Stopping at step (\d+) \(preempted\)", text)
  assert stopped, text[-3000:]
  with Checkpoints(os.path.join(workdir, "checkpoints")) as checkpoints:
    assert int(stopped[1]) in checkpoints.all_steps()


def test_qlora_reference_is_the_base_with_its_adapters_off(tmp_path, data_dir):
  config = grpo_config(data_dir, num_train_steps=2, quantize="int8")
  config.lora.rank = 4
  steps = RecordingSteps(config)
  train_and_evaluate(config, str(tmp_path), steps)
  # The adapters start at B = 0, so the first rollout's policy is the reference exactly; then it moves.
  assert steps.metrics[0]["kl"] == 0.0
  assert steps.metrics[1]["kl"] > 0.0


def test_json_prompts_bring_their_columns_to_the_rewards(tmp_path, data_dir):
  records = [{"query": f"copy: {w}", "answer": w} for w in ("abc", "hello", "xy", "quartz")]
  path = tmp_path / "prompts.json"
  path.write_text(json.dumps(records))
  config = grpo_config(data_dir, num_train_steps=1)
  config.data.update(dataset="json", train_files=str(path))
  config.grpo.rewards = ("helpers.rl_utils.answer_length_reward",)
  steps = RecordingSteps(config)
  train_and_evaluate(config, str(tmp_path / "run"), steps)
  (metrics,) = steps.metrics
  assert metrics["reward_mean"] <= 0.0 and "accuracy" not in metrics  # no response column: nothing to match


def test_bad_prompts_and_misbehaving_rewards_are_refused_by_name(tmp_path, data_dir):
  path = tmp_path / "prompts.jsonl"
  path.write_text('{"query": "copy: ab", "answer": "ab"}\n{"prompt": "copy: cd"}\n')
  config = grpo_config(data_dir, num_train_steps=1)
  config.data.update(dataset="json", train_files=str(path))
  with pytest.raises(DataError, match=r"prompts.jsonl record 1 has no 'query'"):
    train_and_evaluate(config, str(tmp_path / "bad_data"), RecordingSteps(config))
  config = grpo_config(data_dir, num_train_steps=1)
  config.grpo.rewards = ("helpers.rl_utils.raising_reward",)
  with pytest.raises(RewardError, match=r"helpers\.rl_utils\.raising_reward raised RuntimeError: the grader is down"):
    train_and_evaluate(config, str(tmp_path / "bad_reward"), RecordingSteps(config))
  config.grpo.rewards = ("helpers.rl_utils.no_such_reward",)
  with pytest.raises(ValueError, match="has no callable 'no_such_reward'"):
    RecordingSteps(config)


def test_refusion_rollouts_are_replayed_to_their_own_probabilities(tmp_path, data_dir):
  # One update per rollout: its ratio is the replay's probability over the decoder's own, 1 when both are exact.
  config = grpo_config(data_dir, kind="refusion", num_train_steps=2)
  config.grpo.num_iterations = 1
  steps = RecordingSteps(config)
  train_and_evaluate(config, str(tmp_path), steps)
  for metrics in steps.metrics:
    assert metrics["ratio_max"] == pytest.approx(1.0, abs=1e-3) and metrics["ratio_mean"] == pytest.approx(
      1.0, abs=1e-4
    )
    assert metrics["clip_fraction"] == 0.0
    assert metrics["rollout_tpf"] >= 1.0


# Runs in a subprocess: the device count must be set before JAX initialises.
_ON_8_DEVICES = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    sys.path.insert(0, "tests")
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_default_matmul_precision", "highest")
    from helpers.rl_utils import RecordingSteps, grpo_config
    from refusion_jax.training.loop import train_and_evaluate

    config = grpo_config(sys.argv[1], batch_size=4)
    config.mesh.update(data=2, fsdp=4, tensor=1)
    steps = RecordingSteps(config)
    train_and_evaluate(config, sys.argv[2], steps)
    print(json.dumps(steps.metrics))
""")


def test_eight_devices_give_the_one_device_steps(straight, tmp_path, data_dir):
  # The straight run's 4 prompts x 2 answers: a row per device on data=2 x fsdp=4 (parameters sharded four ways).
  sharded = run_json(_ON_8_DEVICES, data_dir, str(tmp_path / "eight"), timeout=600)
  steps = straight[1]
  assert len(sharded) == len(steps.metrics) == 4
  for one, eight in zip(steps.metrics, sharded):
    assert eight["reward_mean"] == one["reward_mean"]  # the same answers were sampled
    for name in ("loss", "pg_loss", "kl", "grad_norm", "ratio_mean"):
      assert eight[name] == pytest.approx(one[name], rel=1e-4, abs=1e-6), name
