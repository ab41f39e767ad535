"""The trainer end to end on the smoke config, its optimizer and step, and Hugging Face initialisation."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx
from helpers.train_utils import REPO, load_config, smoke_config, write_hf_checkpoint

from refusion_jax.checkpoints.load import load, load_model
from refusion_jax.checkpoints.orbax import Checkpoints
from refusion_jax.checkpoints.vocab import resize_vocab
from refusion_jax.data.tokenizer import load_tokenizer
from refusion_jax.model.config import preset, tiny
from refusion_jax.model.transformer import abstract_model, init_model
from refusion_jax.parallel.sharding import LOGICAL_AXIS_RULES, make_mesh
from refusion_jax.training import config_file, run_config
from refusion_jax.training import loop as train
from refusion_jax.training import state as train_state
from refusion_jax.training.objective import ObjectiveConfig
from refusion_jax.training.validation import REPRODUCIBILITY


def test_one_step_trains_evaluates_and_checkpoints(tmp_path, data_dir, capsys):
  config = smoke_config(data_dir, num_train_steps=1, eval_every=1)
  result = train.train_and_evaluate(config, str(tmp_path))
  assert result.step == 1 and result.stopped_by == "finished"
  captured = capsys.readouterr()
  (line,) = [line for line in captured.out.splitlines() if line.startswith("[train] step 1:")]
  pad_fraction = float(line.split("pad_fraction=")[1].split()[0])
  assert 0.0 < pad_fraction < 0.3  # packed rows of the built-in tasks (unpacked: about a half)
  scalars = dict(item.split("=") for item in line.split(": ", 1)[1].split())
  # Throughput per chip; no MFU where the chip's peak is unknown (this CPU).
  assert float(scalars["tokens_per_second_per_chip"]) > 0 and float(scalars["model_tflops_per_chip"]) > 0
  assert "mfu" not in scalars
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
  # The summary says what a run on another CPU may change; the bar's time left counts the evaluation to come.
  assert "Validation exact match" in captured.out and REPRODUCIBILITY in captured.out
  assert "left=" in captured.err and "+ 1 eval" in captured.err
  with Checkpoints(str(tmp_path / "checkpoints")) as checkpoints:
    assert checkpoints.all_steps() == [1]
  events = os.listdir(tmp_path / "tensorboard")
  assert any(name.startswith("events.out.tfevents") for name in events)
  # The run records its resolved config, overrides included, for later commands (eval) to read back.
  assert config_file.read_run_config(config_file.recorded_config_path(str(tmp_path))) == config


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


def test_mdm_with_packing_is_refused_naming_the_field(tmp_path, data_dir):
  config = smoke_config(data_dir, "mdm_baseline", num_train_steps=1)
  config.data.packing = True
  with pytest.raises(ValueError, match="--config.data.packing=False"):
    train.train_and_evaluate(config, str(tmp_path))


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
  model, _ = load(str(tmp_path))  # intact and readable
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(model)))


def test_schedule_warms_up_then_decays_to_the_final_ratio():
  opt = load_config("demo", "").optimizer
  opt.update(lr=1e-3, warmup_steps=10, final_lr_ratio=0.1)
  _, schedule = train_state.make_optimizer(opt, total_steps=110)
  assert float(schedule(0)) == 0.0
  assert float(schedule(5)) == pytest.approx(5e-4)
  assert float(schedule(10)) == pytest.approx(1e-3)
  assert float(schedule(60)) == pytest.approx(0.55e-3, rel=1e-3)  # cosine midpoint
  assert float(schedule(110)) == pytest.approx(1e-4)


def test_gradient_accumulation_equals_the_full_batch():
  """AR objective, every row the same answer length: microbatch means average to the full-batch mean."""
  rng = np.random.default_rng(12)
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
  tx, schedule = optax.sgd(1.0), lambda step: 1.0
  graphdef, _ = abstract_model(model_config)
  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  init = train_state.init_state_fn(model_config, tx, seed=int(rng.integers(1000)))
  placement = train_state.make_placement(init, mesh, LOGICAL_AXIS_RULES)
  outputs = []
  for accum in (1, 4):
    step = placement.jit_step(train_state.make_train_step(graphdef, tx, schedule, objective, accum))
    state, metrics = step(jax.jit(init)(), placement.batch(batch))
    outputs.append((float(metrics["loss"]), float(metrics["grad_norm"]), jax.device_get(state.params)))
  (loss1, norm1, params1), (loss4, norm4, params4) = outputs
  assert loss4 == pytest.approx(loss1, rel=1e-5)
  assert norm4 == pytest.approx(norm1, rel=1e-4)
  for a, b in zip(jax.tree.leaves(params1), jax.tree.leaves(params4)):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_resize_vocab_keeps_old_rows_and_starts_new_rows_near_the_mean():
  model = init_model(tiny(vocab_size=50, tie_embeddings=False), seed=int(np.random.default_rng(13).integers(1000)))
  params = nnx.state(model)
  resized = resize_vocab(params, 64, jax.random.PRNGKey(0))
  embed, head = resized["embed_tokens"].get_value(), resized["lm_head"].get_value()
  assert embed.shape == (64, 64) and head.shape == (64, 64)
  old = params["embed_tokens"].get_value()
  np.testing.assert_array_equal(embed[:50], old)
  np.testing.assert_array_equal(head[:, :50], params["lm_head"].get_value())
  np.testing.assert_allclose(embed[50:], jnp.broadcast_to(old.mean(0), (14, 64)), atol=1e-2 * float(old.std()))
  assert float(jnp.std(embed[50:] - old.mean(0))) > 0  # the new rows are not identical


def test_init_from_a_hf_checkpoint_adds_a_mask_token_and_resizes_the_embeddings(tmp_path, data_dir):
  hf_dir = str(tmp_path / "hf")
  vocab = write_hf_checkpoint(hf_dir)
  hf_embed = np.asarray(load_model(hf_dir).embed_tokens.get_value())
  config = smoke_config(data_dir, num_train_steps=1, eval_every=0, init_from=hf_dir, vocab_multiple=8)
  config.model = ml_collections.ConfigDict(
    dict(preset="tiny", vocab_size=vocab, tie_embeddings=False)
  )  # the checkpoint
  config.optimizer.lr = 1e-6  # one near-zero step: the loaded rows must still be the HF ones
  result = train.train_and_evaluate(config, str(tmp_path / "run"))
  assert result.step == 1

  model, tokenizer = load(str(tmp_path / "run"))
  new_vocab = -(-(vocab + 1) // 8) * 8
  assert model.config.vocab_size == new_vocab and model.config.mask_token_id == vocab
  assert model.lm_head.get_value().shape == (model.config.hidden_size, new_vocab)
  embed = np.asarray(model.embed_tokens.get_value())
  np.testing.assert_allclose(embed[:vocab], hf_embed, atol=1e-4)
  assert tokenizer.mask_id == vocab
  assert tokenizer.encode("add: 1+2") == load_tokenizer(hf_dir).encode("add: 1+2")


def test_weight_decay_spares_biases_and_norm_scales_whatever_their_rank():
  """Qwen2's q/k/v biases are [heads, head_dim]: decay follows the parameter's role, not its rank."""
  rng = np.random.default_rng(14)
  params = nnx.state(init_model(tiny(architecture="qwen2"), seed=0))
  params = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)  # no zero biases
  opt = load_config("demo", "").optimizer
  opt.update(lr=0.1, weight_decay=0.5, warmup_steps=0, decay="constant")
  tx, _ = train_state.make_optimizer(opt, total_steps=10)
  # Zero gradients: Adam moves nothing, so any change is weight decay.
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  after = optax.apply_updates(params, updates)
  decayed = set()
  for (path, before), (_, new) in zip(nnx.to_flat_state(params), nnx.to_flat_state(after)):
    name = ".".join(map(str, path))
    if np.array_equal(new.get_value(), before.get_value()):
      continue
    np.testing.assert_allclose(new.get_value(), before.get_value() * (1 - 0.1 * 0.5), rtol=1e-6, err_msg=name)
    decayed.add(name)
  flat_names = {".".join(map(str, path)) for path, _ in nnx.to_flat_state(params)}
  kernels = {n for n in flat_names if n.endswith("_proj") or n in ("embed_tokens", "lm_head")}
  assert decayed == kernels
  assert any(n.endswith("q_bias") for n in flat_names - decayed)


def test_parameter_without_a_decay_role_is_named():
  with pytest.raises(ValueError, match="'layers.0.mystery'.*decays"):
    train_state.decays((jax.tree_util.DictKey("layers"), jax.tree_util.DictKey(0), jax.tree_util.DictKey("mystery")))


def test_recipe_config_names_its_missing_fields(tmp_path):
  config = load_config("refusion_qwen3_8b", "")
  with pytest.raises(ValueError, match=r"config.init_from .*; config.data.train_files") as error:
    train.train_and_evaluate(config, str(tmp_path))
  assert "Unknown tokenizer" not in str(error.value)


def test_hf_checkpoint_must_match_the_preset_naming_the_field():
  model_fields = load_config("refusion_qwen3_8b", "").model
  checkpoint = tiny()  # not a Qwen3-8B
  with pytest.raises(ValueError, match=r"hidden_size=64, config.model hidden_size=4096"):
    run_config.check_hf_architecture(model_fields, checkpoint, "/models/x")
  for field, value in (("num_layers", 35), ("tie_embeddings", True), ("head_dim", 64)):
    with pytest.raises(ValueError, match=rf"gives {field}="):
      run_config.check_hf_architecture(model_fields, preset("qwen3_8b").replace(**{field: value}), "/models/x")
  # The vocabulary may differ (it follows the tokenizer); an empty preset accepts anything.
  run_config.check_hf_architecture(model_fields, preset("qwen3_8b").replace(vocab_size=151_671), "/models/x")
  model_fields.preset = ""
  run_config.check_hf_architecture(model_fields, checkpoint, "/models/x")


def test_recipe_smoke_variant_fine_tunes_a_small_checkpoint_on_json_data(tmp_path):
  hf_dir = str(tmp_path / "hf")
  write_hf_checkpoint(hf_dir)
  rng = np.random.default_rng(15)
  records = [{"query": f"add: {a}+{b}", "response": str(a + b)} for a, b in rng.integers(0, 50, (24, 2)).tolist()]
  for split, chunk in (("train", records[:16]), ("validation", records[16:])):
    (tmp_path / f"{split}.json").write_text(json.dumps(chunk))
  config = load_config("refusion_qwen3_8b")  # :smoke
  config.init_from = hf_dir
  config.data.update(
    data_dir=str(tmp_path / "data"),
    train_files=str(tmp_path / "train.json"),
    validation_files=str(tmp_path / "validation.json"),
  )
  result = train.train_and_evaluate(config, str(tmp_path / "run"))
  assert result.step == config.num_train_steps and result.stopped_by == "finished"
  assert all(np.isfinite(loss) for loss in result.losses.values())
  assert [step for step, _ in result.evals] == [2, 4]
  assert len(result.samples) == config.eval.num_examples


def test_execution_fields_of_the_config_apply_to_whatever_checkpoint_the_run_starts_from():
  # The AOT report's advice ("--config.model.attention_impl=chunked") must reach the recipe's model, which comes
  # from an HF checkpoint or a resumed run, not from the preset.
  from refusion_jax.model.config import tiny
  from refusion_jax.training.config_file import load_config
  from refusion_jax.training.run_config import run_as_configured

  config = load_config("configs/refusion_qwen3_8b.py")
  config.model.attention_impl = "chunked"
  config.model.attention_chunk = 256
  config.model.scan_layers = True
  saved = tiny(remat=False, attention_impl="xla")  # a checkpoint's meta from before remat policies had names
  ran = run_as_configured(saved, config.model)
  assert (ran.attention_impl, ran.attention_chunk, ran.remat, ran.scan_layers) == ("chunked", 256, "full", True)
  execution = dict(attention_impl="xla", attention_chunk=saved.attention_chunk, remat="none", scan_layers=False)
  assert ran.replace(**execution) == saved


def test_start_fields_of_earlier_versions_are_refused_naming_their_replacement(tmp_path, data_dir):
  for old in ("init_from_hf", "init_from_checkpoint"):
    config = smoke_config(data_dir)
    config[old] = str(tmp_path / "somewhere")
    with pytest.raises(ValueError, match=rf"config.{old} was replaced by config.init_from"):
      train.train_and_evaluate(config, str(tmp_path / old))
  command = [sys.executable, "-m", "refusion_jax.train", "--config=configs/demo.py:smoke", f"--workdir={tmp_path}"]
  out = subprocess.run(
    [*command, "--config.init_from_hf=/models/Qwen3-8B"],
    cwd=REPO,
    env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 2 and "--config.init_from_hf was replaced by config.init_from" in out.stderr


def test_init_format_that_does_not_match_the_checkpoint_is_refused(tmp_path, data_dir):
  hf_dir = str(tmp_path / "hf")
  write_hf_checkpoint(hf_dir)
  config = smoke_config(data_dir, init_from=hf_dir, init_format="tunix")
  with pytest.raises(ValueError, match=r"format='tunix' was asked for, but .* holds a Hugging Face checkpoint"):
    train.train_and_evaluate(config, str(tmp_path / "run"))
