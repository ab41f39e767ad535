"""The trainer end to end on the smoke config, its optimizer and step, and Hugging Face initialisation."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from flax import nnx
from train_utils import load_config, smoke_config

from refusion_jax.checkpoints import hf as hf_io
from refusion_jax.checkpoints.orbax import Checkpoints, abstract_model, load_model_from_checkpoint
from refusion_jax.data.tokenizer import load_tokenizer
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import init_model
from refusion_jax.parallel.sharding import make_mesh
from refusion_jax.training import loop as train
from refusion_jax.training.objective import ObjectiveConfig

pytestmark = pytest.mark.usefixtures("compilation_cache")


def test_one_step_trains_evaluates_and_checkpoints(tmp_path, data_dir):
  config = smoke_config(data_dir, num_train_steps=1, eval_every=1)
  result = train.train_and_evaluate(config, str(tmp_path))
  assert result.step == 1 and result.stopped_by == "finished"
  assert np.isfinite(result.losses[1])
  ((step, metrics),) = result.evals
  assert step == 1
  assert set(metrics) >= {"loss", "ar_loss", "mdm_loss", "exact_match", "tpf"}
  assert 0.0 <= metrics["exact_match"] <= 1.0 and metrics["tpf"] > 0
  assert len(result.samples) == config.eval.num_examples
  assert {"query", "answer", "reference", "correct"} <= set(result.samples[0])
  tasks = {s["task"] for s in result.samples}
  assert tasks and tasks <= set(config.data.tasks)
  for task in tasks:
    correct = [s["correct"] for s in result.samples if s["task"] == task]
    assert metrics[f"exact_match_{task}"] == np.mean(correct)
  assert metrics["exact_match"] == np.mean([s["correct"] for s in result.samples])
  with Checkpoints(str(tmp_path / "checkpoints")) as checkpoints:
    assert checkpoints.all_steps() == [1]
  events = os.listdir(tmp_path / "tensorboard")
  assert any(name.startswith("events.out.tfevents") for name in events)


@pytest.mark.parametrize("name", ["ar_baseline", "mdm_baseline"])
def test_baseline_configs_train_and_decode_with_their_own_decoder(tmp_path, data_dir, name):
  config = smoke_config(data_dir, name, num_train_steps=1, eval_every=1)
  result = train.train_and_evaluate(config, str(tmp_path))
  ((_, metrics),) = result.evals
  assert np.isfinite(metrics["loss"])
  if name == "ar_baseline":
    assert metrics["mdm_loss"] == 0.0
    assert metrics["tpf"] == pytest.approx(1.0)  # one token per forward, by construction
  else:
    assert metrics["ar_loss"] == 0.0
    assert metrics["mean_forwards"] == config.eval.mdm_steps  # every row runs all MDM steps


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, data_dir):
  # An absurd learning rate blows the parameters up after the first real update.
  config = smoke_config(data_dir, num_train_steps=8, eval_every=0)
  config.optimizer.lr = 1e30
  config.checkpoint.every = 1
  with pytest.raises(train.NonFiniteLossError, match=r"at step (\d+)") as error:
    train.train_and_evaluate(config, str(tmp_path))
  bad_step = int(error.value.args[0].split("at step ")[1].split(" ")[0])
  assert "last good checkpoint is step" in str(error.value)
  with Checkpoints(str(tmp_path / "checkpoints")) as checkpoints:
    assert checkpoints.all_steps()[-1] == bad_step - 1  # nothing at or after the bad step
  assert not (tmp_path / "checkpoints" / str(bad_step)).exists()
  model, _ = load_model_from_checkpoint(str(tmp_path))  # intact and readable
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(model)))


def test_schedule_warms_up_then_decays_to_the_final_ratio():
  opt = load_config("demo", "").optimizer
  opt.update(lr=1e-3, warmup_steps=10, final_lr_ratio=0.1)
  _, schedule = train.make_optimizer(opt, total_steps=110)
  assert float(schedule(0)) == 0.0
  assert float(schedule(5)) == pytest.approx(5e-4)
  assert float(schedule(10)) == pytest.approx(1e-3)
  assert float(schedule(60)) == pytest.approx(0.55e-3, rel=1e-3)  # cosine midpoint
  assert float(schedule(110)) == pytest.approx(1e-4)


def test_gradient_accumulation_equals_the_full_batch():
  """AR objective, every row the same answer length: microbatch means average to the full-batch mean."""
  rng = np.random.default_rng()
  model_config = tiny(vocab_size=260, mask_token_id=259, pad_token_id=256)
  batch_size, length = 8, 24
  tokens = rng.integers(0, 256, (batch_size, length)).astype(np.int32)
  batch = dict(
    tokens=tokens,
    prompt_len=rng.integers(2, 8, batch_size).astype(np.int32),
    answer_len=np.full(batch_size, 10, np.int32),
  )
  objective = ObjectiveConfig(kind="ar", mask_id=259, pad_id=256)
  # Plain SGD: the parameter change is the gradient itself (Adam's first step is ~sign(g),
  # which would turn rounding noise in near-zero gradients into lr-sized differences).
  tx, schedule = train.optax.sgd(1.0), lambda step: 1.0
  graphdef, _ = abstract_model(model_config)
  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  init = train.init_state_fn(model_config, tx, seed=int(rng.integers(1000)))
  placement = train.make_placement(init, mesh, train.sharding.LOGICAL_AXIS_RULES)
  outputs = []
  for accum in (1, 4):
    step = placement.jit_step(train.make_train_step(graphdef, tx, schedule, objective, accum))
    state, metrics = step(jax.jit(init)(), placement.batch(batch))
    outputs.append((float(metrics["loss"]), float(metrics["grad_norm"]), jax.device_get(state.params)))
  (loss1, norm1, params1), (loss4, norm4, params4) = outputs
  assert loss4 == pytest.approx(loss1, rel=1e-5)
  assert norm4 == pytest.approx(norm1, rel=1e-4)
  for a, b in zip(jax.tree.leaves(params1), jax.tree.leaves(params4)):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_resize_vocab_keeps_old_rows_and_starts_new_rows_near_the_mean():
  model = init_model(tiny(vocab_size=50, tie_embeddings=False), seed=int(np.random.default_rng().integers(1000)))
  params = nnx.state(model)
  resized = train.resize_vocab(params, 64, jax.random.PRNGKey(0))
  embed, head = resized["embed_tokens"].get_value(), resized["lm_head"].get_value()
  assert embed.shape == (64, 64) and head.shape == (64, 64)
  old = params["embed_tokens"].get_value()
  np.testing.assert_array_equal(embed[:50], old)
  np.testing.assert_array_equal(head[:, :50], params["lm_head"].get_value())
  np.testing.assert_allclose(embed[50:], jnp.broadcast_to(old.mean(0), (14, 64)), atol=1e-2 * float(old.std()))
  assert float(jnp.std(embed[50:] - old.mean(0))) > 0  # the new rows are not identical


def _write_hf_checkpoint(path) -> int:
  """A tiny Qwen3 checkpoint with a character tokenizer that has no mask token; returns its vocab size."""
  chars = [chr(c) for c in range(32, 127)]
  vocab = {c: i for i, c in enumerate(chars + ["<unk>", "<|endoftext|>"])}
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
  tokenizer.decoder = tokenizers.decoders.Fuse()
  tokenizer.add_special_tokens([tokenizers.AddedToken("<|endoftext|>", special=True)])
  os.makedirs(path, exist_ok=True)
  tokenizer.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<|endoftext|>"}, f)
  model_config = tiny(vocab_size=len(vocab), tie_embeddings=False, eos_token_id=vocab["<|endoftext|>"])
  hf_io.save_hf(init_model(model_config, seed=3), path)
  return len(vocab)


def test_init_from_hf_adds_a_mask_token_and_resizes_the_embeddings(tmp_path, data_dir):
  hf_dir = str(tmp_path / "hf")
  vocab = _write_hf_checkpoint(hf_dir)
  hf_embed = np.asarray(hf_io.load_hf(hf_dir).embed_tokens.get_value())
  config = smoke_config(data_dir, num_train_steps=1, eval_every=0, init_from_hf=hf_dir, vocab_multiple=8)
  config.optimizer.lr = 1e-6  # one near-zero step: the loaded rows must still be the HF ones
  result = train.train_and_evaluate(config, str(tmp_path / "run"))
  assert result.step == 1

  model, tokenizer_path = load_model_from_checkpoint(str(tmp_path / "run"))
  new_vocab = -(-(vocab + 1) // 8) * 8
  assert model.config.vocab_size == new_vocab and model.config.mask_token_id == vocab
  assert model.lm_head.get_value().shape == (model.config.hidden_size, new_vocab)
  embed = np.asarray(model.embed_tokens.get_value())
  np.testing.assert_allclose(embed[:vocab], hf_embed, atol=1e-4)
  tokenizer = load_tokenizer(tokenizer_path)
  assert tokenizer.mask_id == vocab
  assert tokenizer.encode("add: 1+2") == load_tokenizer(hf_dir).encode("add: 1+2")
