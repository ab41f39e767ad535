"""The loading front door: every source gives the model and its tokenizer."""

import grain
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from refusion_jax.checkpoints import hf, orbax
from refusion_jax.checkpoints.load import NoTokenizer, detect_format, load
from refusion_jax.data.tokenizer import ByteTokenizer
from refusion_jax.model import config as config_lib
from refusion_jax.model.transformer import init_model


def _seed() -> int:
  return int(np.random.default_rng().integers(1 << 16))


def _logits(model, tokens):
  return np.asarray(model(jnp.asarray(tokens))[0])


def _save_run(workdir, model, step=2):
  with orbax.Checkpoints(str(workdir / orbax.CHECKPOINT_SUBDIR), async_save=False) as checkpoints:
    checkpoints.save(
      step,
      params=nnx.state(model),
      train={"step": step},
      data_iterator=iter(grain.MapDataset.range(2).to_iter_dataset()),
      meta=orbax.model_meta(model.config, "bytes"),
    )
    checkpoints.wait()


def test_every_source_is_detected_and_loads_the_same_weights(tmp_path):
  model = init_model(config_lib.tiny(vocab_size=260), seed=_seed())
  tokens = np.random.default_rng().integers(0, 260, (2, 9))
  hf.save_hf(model, tmp_path / "hf")
  _save_run(tmp_path / "run", model)
  assert detect_format(str(tmp_path / "hf")) == "hf"
  assert detect_format(str(tmp_path / "run")) == "refusion"
  assert detect_format("tiny") == "preset"

  from_hf, hf_tokenizer = load(str(tmp_path / "hf"))
  from_run, run_tokenizer = load(str(tmp_path / "run"))
  assert isinstance(hf_tokenizer, NoTokenizer) and isinstance(run_tokenizer, ByteTokenizer)
  np.testing.assert_array_equal(_logits(from_hf, tokens), _logits(model, tokens))
  np.testing.assert_array_equal(_logits(from_run, tokens), _logits(model, tokens))

  cast, _ = load(str(tmp_path / "run"), dtype="bfloat16")
  assert cast.embed_tokens.get_value().dtype == jnp.bfloat16 and cast.config.dtype == "bfloat16"


def test_preset_gets_random_weights_sized_to_its_tokenizer():
  model, tokenizer = load("tiny", format="preset", seed=3)
  assert isinstance(tokenizer, ByteTokenizer)
  assert model.config.vocab_size == 260 and model.config.mask_token_id == tokenizer.mask_id
  again, _ = load("tiny", format="preset", seed=3)
  np.testing.assert_array_equal(model.embed_tokens.get_value(), again.embed_tokens.get_value())


def test_unknown_source_lists_what_was_looked_for(tmp_path):
  with pytest.raises(FileNotFoundError, match="No checkpoint directory at"):
    load(str(tmp_path / "nothing"))
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match=r"config.json.*\(hf\).*\(refusion\).*\(tunix\).*\(maxtext\)"):
    load(str(tmp_path / "empty"))
  with pytest.raises(ValueError, match="do not apply to the random preset"):
    load("tiny", step=3)
