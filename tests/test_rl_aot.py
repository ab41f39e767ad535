"""`python -m refusion_jax.aot --programs grpo`: a GRPO step's programs compiled ahead of time, and that they are the
trainer's (refusion_jax.rl.trainer builds them for both)."""

import dataclasses
import os
import re
import subprocess
import sys
import types

import jax
from flax import nnx

from refusion_jax.model import lora
from refusion_jax.parallel import compiled, sharding
from refusion_jax.rl import aot_report as rl_aot_report
from refusion_jax.rl import trainer
from refusion_jax.training import aot_report
from refusion_jax.training.config_file import load_config
from refusion_jax.training.run_config import lora_config_from
from refusion_jax.training.state import init_state_fn, make_optimizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _aot(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
  command = [sys.executable, "-m", "refusion_jax.aot", *args]
  return subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)


def test_aot_compiles_the_grpo_rollout_reference_and_update_with_their_rows():
  # The 8B recipe's path on its smoke variant (a tiny LoRA model): 2 prompts x 2 answers over 2 devices.
  out = _aot("--config", "configs/grpo_qwen3_8b.py:smoke", "--programs=grpo", "--hbm_gib=1")
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  table = out.stdout[out.stdout.rindex("| program |") :].splitlines()
  rows = [line for line in table if line.startswith("| GRPO")]
  assert [row.split(" (")[0] for row in rows] == ["| GRPO rollout", "| GRPO reference log-probs", "| GRPO update"]
  assert rows[0].startswith(
    "| GRPO rollout (refusion, speculative, T=1.0, logprobs, prefill + 1 loop iteration), 4 rows"
  )
  assert "(adapters off), 4 rows x (prompt 48 + 16)" in rows[1]
  assert all("LoRA r=4" in row and "mesh data:2 | 2 |" in row and "| yes |" in row for row in rows), rows
  assert re.search(r"Compile times on this host: GRPO rollout [^;]*: \d+ s; GRPO reference", out.stdout)


def test_grpo_programs_need_a_grpo_config_and_names_are_checked():
  out = _aot("--config", "configs/demo.py:smoke", "--programs=grpo")
  assert out.returncode == 2 and "give a config with a `grpo` section" in out.stdout + out.stderr
  out = _aot("--config", "configs/demo.py:smoke", "--programs=rollout")
  assert out.returncode == 2 and "unknown ['rollout']; choose from grpo, train, decode" in out.stdout + out.stderr


def test_the_reports_compile_the_trainers_own_programs(monkeypatch):
  """The update and reference programs are `trainer.update_programs`'s, and the rollout's loop and start state
  those of the engine `trainer.rollout_engine` builds on the train state's parameters (lowered, not compiled)."""
  config = load_config(os.path.join(REPO, "configs/grpo_qwen3_8b.py"), "smoke")
  config.mesh.data = 1
  traced, loops, starts = [], [], []
  update_programs, loop_for, start_state = trainer.update_programs, aot_report.loop_for, aot_report.start_state

  def recording_programs(*args):
    programs = update_programs(*args)
    recorded = lambda name, jitted: types.SimpleNamespace(trace=lambda *a: traced.append(name) or jitted.trace(*a))
    return types.SimpleNamespace(
      update=recorded("update", programs.update), logprobs=recorded("ref", programs.logprobs)
    )

  def lowered_only(name, lower, arguments, devices, chip, loop_count=1):
    lower()
    return compiled.Report(name=name, devices=len(devices), chip=chip)

  monkeypatch.setattr(trainer, "update_programs", recording_programs)
  monkeypatch.setattr(aot_report.compiled, "compile_report", lowered_only)
  monkeypatch.setattr(aot_report, "loop_for", lambda *a: loops.append(loop_for(*a)) or loops[-1])
  monkeypatch.setattr(aot_report, "start_state", lambda *a: starts.append(start_state(*a)) or starts[-1])
  reports = list(rl_aot_report.grpo_reports(config, jax.devices()[:1], None))
  assert [r.name.split(" (")[0] for r in reports] == ["GRPO rollout", "GRPO reference log-probs", "GRPO update"]
  assert traced == ["ref", "update"] and len(loops) == len(starts) == 1

  # The trainer's rollout engine on real parameters of the same model, mesh and options.
  steps = trainer.GRPOSteps(config)
  model_config = aot_report.model_config_of(config)
  tx, _ = make_optimizer(config.optimizer, total_steps=config.num_train_steps)
  state = init_state_fn(model_config, tx, config.seed, lora_config_from(config))()
  graphdef, _ = lora.abstract_lora_model(model_config, lora_config_from(config))
  mesh = sharding.make_mesh(dict(config.mesh), jax.devices()[:1])
  options = dataclasses.replace(trainer.rollout_options(config, mesh), rows=trainer.rollout_rows(config, steps))
  engine = trainer.rollout_engine(nnx.merge(graphdef, state.params), steps, options, config.sharding_rules)
  assert engine._loop == loops[0]
  shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
  assert shapes(engine._state) == shapes(starts[0])
