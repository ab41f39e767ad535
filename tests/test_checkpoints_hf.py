"""Hugging Face checkpoint I/O: config mapping, save/load round trips, shards,
bfloat16, and the errors a checkpoint that does not fit must raise."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from helpers.closeness import relative_error
from helpers.hf_utils import hf_logits, save_tiny_hf_model, tiny_hf_model
from helpers.torch_reference import torch
from safetensors.numpy import load_file, save_file

from refusion_jax.checkpoints.hf import config_from_hf, config_to_hf, load_hf_config, save_hf
from refusion_jax.checkpoints.load import load_model

LLAMA3_ROPE = dict(
  rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

FAMILY_CASES = {
  "qwen3_tied_linear_rope": (
    "qwen3",
    dict(head_dim=16, tie_word_embeddings=True, rope_scaling={"type": "linear", "factor": 2.0}),
  ),
  "qwen2_theta1e6": ("qwen2", dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=48, rope_theta=1e6)),
  "llama_mqa": ("llama", dict(num_attention_heads=3, num_key_value_heads=1, hidden_size=48)),
  "llama_llama3_rope": ("llama", dict(rope_theta=5e5, rope_scaling=dict(LLAMA3_ROPE, factor=32.0))),
}


def _random_tokens(seed, vocab=211, shape=(2, 13)):
  return np.random.default_rng(seed).integers(0, vocab, shape)


def _logits(model, tokens):
  return np.asarray(model(jnp.asarray(tokens))[0])


def _params(model):
  return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _rewrite(file, change):
  """Apply `change` to the {name: array} dict of a safetensors file in place."""
  tensors = load_file(file)
  change(tensors)
  save_file(tensors, file, metadata={"format": "pt"})


# --------------------------------------------------------------------------
# config.json mapping.


def _qwen3_8b_like(**changes):
  fields = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151_671,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
    "rope_theta": 1_000_000,
    "rope_scaling": None,
    "eos_token_id": 151645,
    "pad_token_id": 151643,
  }
  fields.update(changes)
  return fields


def test_config_maps_a_refusion_config_to_the_preset():
  from refusion_jax.model.config import refusion_8b

  assert config_from_hf(_qwen3_8b_like()) == refusion_8b()


def test_config_reads_transformers5_rope_parameters_like_the_legacy_fields():
  legacy = config_from_hf(_qwen3_8b_like(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 3.0}))
  new = _qwen3_8b_like(rope_parameters={"rope_type": "linear", "factor": 3.0, "rope_theta": 5e5})
  del new["rope_theta"], new["rope_scaling"]
  assert config_from_hf(new) == legacy
  # A legacy rope_scaling entry (no theta in it) overrides rope_parameters, as in transformers 5.
  both = dict(
    new, rope_parameters={"rope_type": "default", "rope_theta": 5e5}, rope_scaling={"type": "linear", "factor": 3.0}
  )
  assert config_from_hf(both) == legacy
  assert (legacy.rope_theta, legacy.rope_scaling_factor) == (5e5, 3.0)


def test_config_reads_and_writes_llama3_rope_scaling():
  config = config_from_hf(_qwen3_8b_like(architectures=["LlamaForCausalLM"], rope_scaling=LLAMA3_ROPE))
  assert (config.rope_scaling, config.rope_scaling_factor, config.rope_original_max_position) == ("llama3", 8.0, 8192)
  assert (config.rope_low_freq_factor, config.rope_high_freq_factor) == (1.0, 4.0)
  assert config_from_hf(config_to_hf(config)) == config


def test_config_defaults_kv_heads_and_head_dim_and_takes_first_eos():
  fields = _qwen3_8b_like(eos_token_id=[7, 9], architectures=None, model_type="llama")
  del fields["num_key_value_heads"], fields["head_dim"]
  config = config_from_hf(fields)
  assert (config.architecture, config.num_kv_heads, config.head_dim, config.eos_token_id) == ("llama", 32, 128, 7)
  assert not config.qk_norm and not config.qkv_bias


@pytest.mark.parametrize(
  "changes, culprit",
  [
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
    (dict(architectures=["LlamaForCausalLM"], mlp_bias=True), "mlp_bias"),
    (dict(architectures=["LlamaForCausalLM"], attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "gelu"),
  ],
)
def test_config_rejects_unsupported_features_by_name(changes, culprit):
  with pytest.raises(NotImplementedError, match=culprit):
    config_from_hf(_qwen3_8b_like(**changes))


def test_config_rejects_unknown_architecture_listing_supported_ones():
  with pytest.raises(ValueError, match=r"MistralForCausalLM.*Qwen3ForCausalLM"):
    config_from_hf(_qwen3_8b_like(architectures=["MistralForCausalLM"], model_type="mistral"))


def test_mask_token_comes_from_tokenizer_files_unless_config_has_one(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(_qwen3_8b_like()))
  decoder = {"151643": {"content": "<|endoftext|>"}, "151669": {"content": "<|mask|>"}}
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
  assert load_hf_config(tmp_path).mask_token_id == 151669

  (tmp_path / "config.json").write_text(json.dumps(_qwen3_8b_like(mask_token_id=151670)))
  assert load_hf_config(tmp_path).mask_token_id == 151670


# --------------------------------------------------------------------------
# Round trips.


@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_save_hf_is_loaded_by_transformers_with_the_same_logits(case, tmp_path):
  family, fields = FAMILY_CASES[case]
  save_tiny_hf_model(tmp_path / "hf", family, seed=3, **fields)
  model = load_model(tmp_path / "hf")
  save_hf(model, tmp_path / "ours")

  reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
    tmp_path / "ours", dtype=torch.float32, attn_implementation="eager", output_loading_info=True
  )
  assert (
    type(reloaded).__name__
    == {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[family]
  )
  assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
  tokens = _random_tokens(4)
  assert relative_error(hf_logits(reloaded.eval(), tokens), _logits(model, tokens)) <= 1e-5


def test_load_hf_reads_a_sharded_save_pretrained_checkpoint(tmp_path):
  hf_model = tiny_hf_model("qwen3", seed=5)
  hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 2

  tokens = _random_tokens(6)
  assert relative_error(_logits(load_model(tmp_path), tokens), hf_logits(hf_model, tokens)) <= 1e-5


def test_save_hf_shards_round_trip_exactly(tmp_path):
  save_tiny_hf_model(tmp_path / "hf", "qwen2", seed=7)
  model = load_model(tmp_path / "hf")
  save_hf(model, tmp_path / "ours", max_shard_bytes=30_000)

  index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
  shards = set(index["weight_map"].values())
  assert len(shards) > 2 and all((tmp_path / "ours" / shard).exists() for shard in shards)
  assert not (tmp_path / "ours" / "model.safetensors").exists()
  reloaded = load_model(tmp_path / "ours")
  original, again = _params(model), _params(reloaded)
  assert original.keys() == again.keys()
  for path in original:
    np.testing.assert_array_equal(again[path], original[path], err_msg=str(path))


def test_bfloat16_checkpoint_loads_exactly_in_either_dtype(tmp_path):
  hf_model = tiny_hf_model("qwen3", seed=8).to(torch.bfloat16)
  hf_model.save_pretrained(tmp_path)
  assert load_file(tmp_path / "model.safetensors")["model.norm.weight"].dtype.name == "bfloat16"
  bf16 = load_model(tmp_path, dtype="bfloat16")
  f32 = load_model(tmp_path, dtype="float32")

  embed = hf_model.model.embed_tokens.weight.detach().float().numpy()
  assert bf16.embed_tokens.get_value().dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(bf16.embed_tokens.get_value(), np.float32), embed)
  np.testing.assert_array_equal(np.asarray(f32.embed_tokens.get_value()), embed)
  tokens = _random_tokens(9)
  # Same weights, bfloat16 activations: close to the float32 forward, not equal.
  assert relative_error(_logits(bf16, tokens), _logits(f32, tokens)) <= 5e-2


def test_tied_checkpoint_with_identical_lm_head_loads(tmp_path):
  hf_model = save_tiny_hf_model(tmp_path, "llama", seed=10, tie_word_embeddings=True)
  file = tmp_path / "model.safetensors"
  _rewrite(file, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
  tokens = _random_tokens(11)
  assert relative_error(_logits(load_model(tmp_path), tokens), hf_logits(hf_model, tokens)) <= 1e-5


# --------------------------------------------------------------------------
# Checkpoints that do not fit.


@pytest.fixture
def checkpoint(tmp_path):
  save_tiny_hf_model(tmp_path, "qwen3", seed=12, head_dim=8)
  return tmp_path


def test_wrong_shape_names_the_tensor_and_both_shapes(checkpoint):
  name = "model.layers.1.self_attn.k_proj.weight"
  _rewrite(checkpoint / "model.safetensors", lambda t: t.update({name: t[name][:-8]}))
  with pytest.raises(ValueError, match=rf"{name} has shape \(8, 32\), expected \(16, 32\).*does not fit the config"):
    load_model(checkpoint)


def test_checkpoint_that_does_not_fit_a_config_override_is_refused(checkpoint):
  with pytest.raises(ValueError, match=r"vocab_size: the config has 300, the checkpoint's arrays say 211"):
    load_model(checkpoint, config=load_hf_config(checkpoint).replace(vocab_size=300))


def test_missing_tensor_is_named(checkpoint):
  name = "model.layers.1.mlp.down_proj.weight"
  _rewrite(checkpoint / "model.safetensors", lambda t: t.pop(name))
  with pytest.raises(ValueError, match=rf"lacks 1 tensors.*{name}"):
    load_model(checkpoint)


@pytest.mark.parametrize(
  "name", ["model.layers.0.self_attn.rotary_emb.inv_freq", "model.layers.0.self_attn.q_proj.bias"]
)
def test_extra_tensor_is_named(checkpoint, name):
  _rewrite(checkpoint / "model.safetensors", lambda t: t.update({name: np.ones(64, np.float32)}))
  with pytest.raises(ValueError, match=rf"tensor {name} .*does not fit the config"):
    load_model(checkpoint)


def test_tied_lm_head_that_differs_from_the_embedding_is_refused(tmp_path):
  save_tiny_hf_model(tmp_path, "qwen3", seed=13, tie_word_embeddings=True)
  _rewrite(tmp_path / "model.safetensors", lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1.0}))
  with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
    load_model(tmp_path)


def test_unknown_architecture_is_named(checkpoint):
  config = json.loads((checkpoint / "config.json").read_text())
  config["architectures"] = ["GPTNeoXForCausalLM"]
  (checkpoint / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"GPTNeoXForCausalLM.*supported"):
    load_model(checkpoint)


def test_truncated_shard_is_named(tmp_path):
  hf_model = tiny_hf_model("qwen3", seed=14)
  hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
  shard = sorted(tmp_path.glob("model-*-of-*.safetensors"))[1]
  shard.write_bytes(shard.read_bytes()[:-100])
  with pytest.raises(ValueError, match=rf"{shard.name}.*truncated"):
    load_model(tmp_path)


def test_save_refuses_a_config_no_hugging_face_family_has(tmp_path):
  from refusion_jax.model.config import tiny
  from refusion_jax.model.transformer import init_model

  with pytest.raises(ValueError, match="qkv_bias=True"):
    save_hf(init_model(tiny(architecture="llama", qkv_bias=True)), tmp_path)
