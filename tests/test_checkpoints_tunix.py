"""tunix checkpoints through the front door: real checkpoints and logits committed by
tests/helpers/make_tunix_fixtures.py, the errors that name what does not fit, `inspect_checkpoint`, and sampling and
training from one."""

import json
import pathlib

import numpy as np
import pytest
from flax import nnx
from helpers.checkpoint_cases import (
  TOLERANCE,
  TUNIX,
  logits,
  tunix_case,
)
from helpers.closeness import relative_error
from helpers.train_utils import smoke_config
from helpers.tunix_layout import save_tunix_layout

import refusion_jax as rj
from refusion_jax import sample
from refusion_jax.checkpoints.hf import config_to_hf
from refusion_jax.checkpoints.load import inspect_checkpoint, load, load_model
from refusion_jax.data.tokenizer import ByteTokenizer
from refusion_jax.model.transformer import init_model
from refusion_jax.training.loop import train_and_evaluate
from refusion_jax.training.run_config import model_config_from

REPO = str(pathlib.Path(__file__).parent.parent)

# ------------------------------------------------------------------- tunix


@pytest.mark.parametrize(
  "family, where",
  [("qwen3", "root"), ("qwen2", "step folder"), ("llama", "item folder")],
)
def test_tunix_checkpoint_reproduces_tunix_logits(family, where):
  config, reference = tunix_case(family)
  path = {
    "root": TUNIX / family,
    "step folder": TUNIX / family / "3",
    "item folder": TUNIX / family / "3" / "model_params",
  }
  model = load_model(str(path[where]), config=config)
  ratio = relative_error(logits(model, reference["tokens"], reference["positions"]), reference["logits"])
  print(f"\n[tunix parity] {family} ({where}): max|diff| / max|logit| = {ratio:.2e}")
  assert ratio <= TOLERANCE
  assert model.config.tie_embeddings == (family == "qwen2")


def test_tunix_without_a_config_asks_for_one():
  with pytest.raises(ValueError, match="does not store the model's config.*pass config="):
    load_model(str(TUNIX / "qwen3"))


def test_lora_only_tunix_checkpoint_is_refused_saying_so():
  with pytest.raises(ValueError, match=r"LoRA-only \(saved with save_only_lora_params=True\).*w_lora_a"):
    load_model(str(TUNIX / "lora"), config=tunix_case("qwen3")[0])


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(num_heads=8, num_kv_heads=4), r"num_heads: the config has 8, the checkpoint's arrays say 4"),
    (dict(intermediate_size=64), r"intermediate_size: the config has 64, the checkpoint's arrays say 32"),
    (dict(architecture="qwen2", qk_norm=False, qkv_bias=True), r"qk_norm: the config has False.*qkv_bias"),
    (dict(tie_embeddings=True), r"tie_embeddings: the config has True"),
  ],
)
def test_config_that_disagrees_with_the_arrays_is_refused_naming_the_field(changes, message):
  config, _ = tunix_case("qwen3")
  with pytest.raises(ValueError, match=message):
    load_model(str(TUNIX / "qwen3"), config=config.replace(**changes))


def test_format_asked_for_must_be_the_one_found():
  with pytest.raises(ValueError, match="format='maxtext' was asked for.*tunix checkpoint"):
    load_model(str(TUNIX / "qwen3"), format="maxtext", config="tiny")


def test_inspect_reports_format_arrays_and_inferred_fields():
  info = inspect_checkpoint(str(TUNIX / "qwen2"))
  assert info.format == "tunix" and info.arrays["layers.0.attn.q_bias.value"][0] == (32,)
  assert info.fields == dict(
    vocab_size=48,
    hidden_size=16,
    intermediate_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qk_norm=False,
    qkv_bias=True,
    tie_embeddings=True,
  )
  assert "stored config: none" in str(info)
  lora = inspect_checkpoint(str(TUNIX / "lora"))  # shown, though not loadable
  assert all("_lora_" in name for name in lora.arrays) and lora.unknown


# ------------------------------------------------------------------- entry points


def test_sample_cli_decodes_from_a_tunix_checkpoint(tmp_path, capsys):
  config, _ = tunix_case("qwen3")
  config = config.replace(eos_token_id=47, pad_token_id=46)
  (tmp_path / "config").mkdir()
  (tmp_path / "config" / "config.json").write_text(json.dumps(config_to_hf(config)))
  argv = ["--checkpoint", TUNIX / "qwen3", "--model_config", tmp_path / "config", "--prompt_ids", "5,9,2"]
  assert sample.main([str(a) for a in [*argv, "--method", "ar", "--gen_length", 6, "--json"]]) == 0
  tokens = json.loads(capsys.readouterr().out)["tokens"]
  model = load_model(str(TUNIX / "qwen3"), config=config)
  assert tokens == rj.decode(model, [[5, 9, 2]], rj.AR(gen_length=6), eos_id=47, pad_id=46).tokens[0]
  assert sample.main([str(a) for a in argv[:2] + ["--prompt_ids", "5"]]) == 2
  assert "does not store the model's config" in capsys.readouterr().err


def test_training_starts_from_a_tunix_checkpoint(tmp_path, data_dir):
  config = smoke_config(data_dir, num_train_steps=1, eval_every=0)
  seed = int(np.random.default_rng().integers(1, 1000))  # not the run's own init seed (0)
  start = init_model(model_config_from(config, ByteTokenizer()), seed=seed)
  save_tunix_layout(start, str(tmp_path / "tunix"))
  config.init_from = str(tmp_path / "tunix")
  config.optimizer.lr = 1e-6  # one near-zero step: the parameters must still be the checkpoint's
  assert train_and_evaluate(config, str(tmp_path / "run")).step == 1
  trained, _ = load(str(tmp_path / "run"))
  for (path, ours), (_, theirs) in zip(nnx.to_flat_state(nnx.state(trained)), nnx.to_flat_state(nnx.state(start))):
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-4, err_msg=str(path))
