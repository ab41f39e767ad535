"""Checkpoints: exact resume, preemption (SIGTERM), unreadable or misfitting checkpoints, rebuilding a model."""

import os
import re
import signal
import subprocess
import sys

import grain
import jax
import numpy as np
import pytest
from flax import nnx
from helpers.train_utils import REPO, smoke_config

from refusion_jax.checkpoints.load import load
from refusion_jax.checkpoints.orbax import Checkpoints, model_meta
from refusion_jax.data.tokenizer import ByteTokenizer
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import abstract_model, init_model
from refusion_jax.training import loop as train


def _params_of(workdir: str) -> dict:
  model, _ = load(workdir)
  return {path: np.asarray(v) for path, v in nnx.to_flat_state(nnx.state(model))}


def test_resumed_run_continues_exactly(tmp_path, data_dir):
  config = smoke_config(data_dir, num_train_steps=6, eval_every=0)
  straight = train.train_and_evaluate(config, str(tmp_path / "straight"))

  config.stop_after_step = 3
  first = train.train_and_evaluate(config, str(tmp_path / "resumed"))
  assert first.stopped_by == "stop_after_step" and first.step == 3
  config.stop_after_step = -1
  second = train.train_and_evaluate(config, str(tmp_path / "resumed"))
  assert sorted(second.losses) == [4, 5, 6]

  resumed_losses = {**first.losses, **second.losses}
  # Same batches, same randomness, same arithmetic: bitwise equal on the CPU.
  assert [resumed_losses[s] for s in range(1, 7)] == [straight.losses[s] for s in range(1, 7)]
  straight_params, resumed_params = _params_of(str(tmp_path / "straight")), _params_of(str(tmp_path / "resumed"))
  for path in straight_params:
    np.testing.assert_array_equal(resumed_params[path], straight_params[path], err_msg=str(path))


def test_sigterm_saves_a_checkpoint_exits_cleanly_and_the_run_resumes(tmp_path, data_dir):
  workdir = str(tmp_path / "run")
  command = [
    sys.executable,
    "-m",
    "refusion_jax.train",
    "--config",
    "configs/demo.py:smoke",
    "--workdir",
    workdir,
    f"--config.data.data_dir={data_dir}",
    "--config.num_train_steps=1000",
    "--config.eval_every=0",
    "--config.checkpoint.every=1000",
  ]
  env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
  process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  output = []
  try:
    for line in process.stdout:
      output.append(line)
      if "[train] step 2:" in line:
        process.send_signal(signal.SIGTERM)
        break
    output.append(process.communicate(timeout=120)[0])
  finally:
    process.kill()
  text = "".join(output)
  assert process.returncode == 0, text[-3000:]
  stopped = re.search(r"Stopping at step (\d+) \(preempted\)", text)
  assert stopped, text[-3000:]
  step = int(stopped[1])
  with Checkpoints(os.path.join(workdir, "checkpoints")) as checkpoints:
    assert checkpoints.all_steps() == [step]

  config = smoke_config(data_dir, num_train_steps=1000, eval_every=0, stop_after_step=step + 2)
  config.checkpoint.every = 1000
  resumed = train.train_and_evaluate(config, workdir)
  assert sorted(resumed.losses) == [step + 1, step + 2]


def _tiny_checkpoint(directory: str, model_config):
  """Save step 7 of a random model (plus a data iterator 3 elements in); return the model."""
  model = init_model(model_config, seed=int(np.random.default_rng(7).integers(1000)))
  iterator = iter(grain.MapDataset.range(100).to_iter_dataset())
  for _ in range(3):
    next(iterator)
  train_part = dict(step=np.int32(7), rng=np.asarray(jax.random.PRNGKey(1)))
  with Checkpoints(directory) as checkpoints:
    checkpoints.save(
      7, params=nnx.state(model), train=train_part, data_iterator=iterator, meta=model_meta(model_config, "bytes")
    )
    checkpoints.wait()
  return model


def _abstract_params(model_config):
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  _, state = abstract_model(model_config)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), state)


def test_restore_returns_params_and_moves_the_data_iterator(tmp_path):
  model_config = tiny(vocab_size=64)
  model = _tiny_checkpoint(str(tmp_path), model_config)
  fresh_iterator = iter(grain.MapDataset.range(100).to_iter_dataset())
  with Checkpoints(str(tmp_path)) as checkpoints:
    restored = checkpoints.restore(7, abstract_params=_abstract_params(model_config), data_iterator=fresh_iterator)
  assert next(fresh_iterator) == 3
  for (path, value), (_, saved) in zip(nnx.to_flat_state(restored.params), nnx.to_flat_state(nnx.state(model))):
    np.testing.assert_array_equal(np.asarray(value), np.asarray(saved), err_msg=str(path))
  assert restored.meta["tokenizer"] == "bytes"


def test_load_rebuilds_the_model_and_its_tokenizer_from_a_run(tmp_path):
  model_config = tiny(vocab_size=64, num_layers=3)
  original = _tiny_checkpoint(str(tmp_path), model_config)
  model, tokenizer = load(str(tmp_path))
  assert model.config == model_config and isinstance(tokenizer, ByteTokenizer)
  tokens = np.random.default_rng(8).integers(0, 64, (2, 5))
  np.testing.assert_array_equal(np.asarray(model(tokens)[0]), np.asarray(original(tokens)[0]))


def test_checkpoint_of_another_model_is_rejected_naming_the_parameter(tmp_path):
  _tiny_checkpoint(str(tmp_path), tiny(vocab_size=64))
  with (
    Checkpoints(str(tmp_path)) as checkpoints,
    pytest.raises(ValueError, match=r"'embed_tokens' with shape \(64, 64\).*needs \(80, 64\)"),
  ):
    checkpoints.restore(7, abstract_params=_abstract_params(tiny(vocab_size=80)))


def test_truncated_checkpoint_is_reported_clearly(tmp_path):
  model_config = tiny(vocab_size=64)
  _tiny_checkpoint(str(tmp_path), model_config)
  data_files = [  # the array chunks live in OCDBT "d" directories
    os.path.join(root, name)
    for root, _, names in os.walk(tmp_path / "7" / "params")
    for name in names
    if os.path.basename(root) == "d"
  ]
  assert data_files
  for path in data_files:
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
  with (
    Checkpoints(str(tmp_path)) as checkpoints,
    pytest.raises(ValueError, match="could not be read; it may be truncated or corrupt"),
  ):
    checkpoints.restore(7, abstract_params=_abstract_params(model_config))


def test_missing_step_is_reported(tmp_path):
  _tiny_checkpoint(str(tmp_path), tiny(vocab_size=64))
  with (
    Checkpoints(str(tmp_path)) as checkpoints,
    pytest.raises(ValueError, match=r"No checkpoint for step 8 .* saved steps: \[7\]"),
  ):
    checkpoints.restore(8, abstract_params=_abstract_params(tiny(vocab_size=64)))


def test_url_workdirs_are_refused_before_anything_is_written(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match="'gs://bucket/run' is a URL.*gcsfuse"):
    train.train_and_evaluate(smoke_config(str(tmp_path / "data")), "gs://bucket/run")
  with pytest.raises(ValueError, match="is a URL"):
    load("gs://bucket/run")
  assert os.listdir(tmp_path) == []
