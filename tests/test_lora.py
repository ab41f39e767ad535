"""LoRA: adapters on the model, training only them, peft's files both ways, merging, runs that resume exactly."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.closeness import assert_same_adapter_gradients
from helpers.train_utils import REPO, adapter_steps, load_config, lora_run_straight_and_resumed, smoke_config

import refusion_jax as rj
from refusion_jax import train_bench
from refusion_jax.checkpoints import lora_run, orbax_tree
from refusion_jax.checkpoints.hf import save_hf
from refusion_jax.checkpoints.load import load, load_model
from refusion_jax.model import flops, lora
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import Transformer, init_model
from refusion_jax.parallel import sharding
from refusion_jax.training import loop as train

ALL = tuple(lora.TARGETS)


def _tokens(seed: int, batch: int = 2, length: int = 11, vocab: int = 96) -> jax.Array:
  return jax.random.randint(jax.random.PRNGKey(seed), (batch, length), 0, vocab)


def _randomise_adapters(model: Transformer, seed: int) -> Transformer:
  """Both factors random (a fresh adapter's B is zero, which would hide a wrong B layout)."""
  graphdef, state = nnx.split(model)

  def noise(path, x):
    if not lora.is_adapter(path):
      return x
    key = jax.random.fold_in(jax.random.PRNGKey(seed), hash(jax.tree_util.keystr(path)) % 2**31)
    return 0.1 * jax.random.normal(key, x.shape, x.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(noise, state))


def test_fresh_adapters_give_the_base_logits_exactly():
  config = tiny(vocab_size=96)
  tokens = _tokens(0)
  base, _ = init_model(config, seed=3)(tokens)
  adapted, _ = lora.add_lora(init_model(config, seed=3), lora.LoraConfig(rank=4, targets=ALL))(tokens)
  np.testing.assert_array_equal(np.asarray(adapted), np.asarray(base))


def test_adapters_change_the_function_and_merging_keeps_it():
  config = tiny(vocab_size=96)
  model = _randomise_adapters(lora.add_lora(init_model(config, seed=1), lora.LoraConfig(rank=4, targets=ALL)), 5)
  tokens = _tokens(1)
  base, _ = init_model(config, seed=1)(tokens)
  unmerged, _ = model(tokens)
  merged_model = lora.merge_lora(model)
  merged, _ = merged_model(tokens)
  assert np.max(np.abs(np.asarray(unmerged - base))) > 1e-2
  np.testing.assert_allclose(np.asarray(merged), np.asarray(unmerged), atol=2e-5, rtol=0)
  assert not list(lora.adapted_kernels(merged_model)) and len(list(lora.adapted_kernels(model))) == 14


@pytest.mark.parametrize("remat", ["full", "projections", "projections_except_mlp"])
def test_scanned_and_rematerialised_layers_equal_the_unrolled_ones(remat):
  config = tiny(vocab_size=96)
  model = _randomise_adapters(lora.add_lora(init_model(config, seed=2), lora.LoraConfig(rank=4, targets=ALL)), 6)
  graphdef, state = nnx.split(model)
  tokens = _tokens(2)
  variant = config.replace(scan_layers=True, remat=remat)
  graphdef_variant, _ = nnx.split(
    lora.add_lora(Transformer(variant, rngs=nnx.Rngs(0)), lora.LoraConfig(rank=4, targets=ALL))
  )

  assert_same_adapter_gradients(graphdef, graphdef_variant, state, tokens)


def test_dropout_draws_apply_only_with_a_key():
  config = tiny(vocab_size=96)
  settings = lora.LoraConfig(rank=4, dropout=0.5)
  model = _randomise_adapters(lora.add_lora(init_model(config, seed=1), settings), 3)
  tokens = _tokens(3)
  plain, _ = model(tokens)
  dropped, _ = model(tokens, dropout_key=jax.random.PRNGKey(0))
  again, _ = model(tokens, dropout_key=jax.random.PRNGKey(0))
  assert np.max(np.abs(np.asarray(dropped - plain))) > 1e-3
  np.testing.assert_array_equal(np.asarray(dropped), np.asarray(again))


def test_only_adapters_train_and_the_optimizer_holds_state_for_them_alone():
  # A bfloat16 base: the adapters and their Adam moments stay float32.
  config = tiny(vocab_size=96, param_dtype="bfloat16")
  before, after = adapter_steps(lora.add_lora(init_model(config, seed=0), lora.LoraConfig(rank=4)))
  adapters, frozen = lora.split_adapters(before.params)
  moments = [x for x in jax.tree.leaves(before.opt_state) if getattr(x, "ndim", 0) > 0]
  assert sum(x.size for x in moments) == 2 * sum(x.size for x in jax.tree.leaves(adapters))
  assert {x.dtype for x in moments} == {jnp.dtype(jnp.float32)}
  assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}

  new_adapters, new_frozen = lora.split_adapters(after.params)
  for before, after in zip(jax.tree.leaves(frozen), jax.tree.leaves(new_frozen)):
    np.testing.assert_array_equal(np.asarray(after), np.asarray(before))
  for path, before in nnx.to_flat_state(adapters):
    after = dict(nnx.to_flat_state(new_adapters))[path]
    assert not np.array_equal(np.asarray(after), np.asarray(before)), path


def test_lora_step_flops_have_no_weight_gradients_of_frozen_kernels():
  config = tiny(vocab_size=96)
  settings = lora.LoraConfig(rank=4)
  lengths = np.array([10, 7])
  full = flops.training_flops(config, lengths)
  adapted = flops.training_flops(config, lengths, lora=settings)
  attention = flops.training_flops(config, lengths) - 6 * flops.matmul_weights(config) * 17
  expected = 4 * flops.matmul_weights(config) * 17 + 6 * flops.adapter_weights(config, settings) * 17 + attention
  assert adapted == pytest.approx(expected)
  assert adapted < full
  # Every adapter weight is multiplied once per token: the count is the adapters' parameter count.
  adapters, _ = lora.split_adapters(nnx.state(lora.add_lora(init_model(config), settings)))
  assert flops.adapter_weights(config, settings) == sum(x.size for x in jax.tree.leaves(adapters))


def test_adapters_are_placed_by_the_logical_axes_of_their_kernels():
  model = lora.add_lora(init_model(tiny(vocab_size=96)), lora.LoraConfig(rank=4, targets=ALL))
  mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"))
  specs = {
    ".".join(map(str, path)): s.spec
    for path, s in nnx.to_flat_state(sharding.state_shardings(nnx.state(model), mesh))
    if lora.is_adapter(path)
  }
  P = jax.sharding.PartitionSpec
  assert specs["layers.0.self_attn.q_proj_lora.lora_a"] == P("fsdp", None)
  assert specs["layers.0.self_attn.q_proj_lora.lora_b"] == P(None, "tensor", None)
  assert specs["layers.1.self_attn.o_proj_lora.lora_a"] == P("tensor", None, None)
  assert specs["layers.1.mlp.down_proj_lora.lora_b"] == P(None, "fsdp")


def test_a_target_no_module_has_names_the_modules_there_are():
  with pytest.raises(ValueError, match="q_proj.*gate_proj.*down_proj"):
    lora.LoraConfig(rank=8, targets=("q_proj", "query"))


# ------------------------------------------------------------------ peft's files


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
  from helpers.hf_utils import save_tiny_hf_model

  directory = tmp_path_factory.mktemp("hf_base")
  save_tiny_hf_model(directory, "qwen3", seed=4, head_dim=8)
  return str(directory)


def _hf(directory: str):
  import transformers

  return transformers.Qwen3ForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()


def _hf_logits(model, tokens):
  from helpers.hf_utils import hf_logits

  return hf_logits(model, np.asarray(tokens))


@pytest.mark.parametrize("use_rslora", [False, True])
def test_a_peft_adapter_loads_onto_our_model_with_peft_logits(hf_base, tmp_path, use_rslora):
  peft_lib = pytest.importorskip("peft")
  settings = peft_lib.LoraConfig(
    r=4, lora_alpha=8, target_modules=list(ALL), lora_dropout=0.0, init_lora_weights=False, use_rslora=use_rslora
  )
  reference = peft_lib.get_peft_model(_hf(hf_base), settings).eval()
  reference.save_pretrained(tmp_path)
  tokens = _tokens(4, vocab=211)
  ours = load_model(hf_base, format="hf", lora=str(tmp_path))
  logits, _ = ours(tokens)
  expected = _hf_logits(reference, tokens)
  assert np.max(np.abs(expected - _hf_logits(_hf(hf_base), tokens))) > 1e-2  # the adapters matter
  np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-5, rtol=0)


def test_our_adapters_load_in_peft_with_our_logits(hf_base, tmp_path):
  peft_lib = pytest.importorskip("peft")
  settings = lora.LoraConfig(
    rank=4, alpha=16, dropout=0.01, targets=("q_proj", "k_proj", "v_proj", "o_proj", "up_proj")
  )
  model = _randomise_adapters(lora.add_lora(load_model(hf_base, format="hf"), settings), 9)
  rj.save_lora(model, str(tmp_path), base_model_name_or_path=hf_base)
  written = json.loads((tmp_path / "adapter_config.json").read_text())
  assert written["r"] == 4 and written["lora_alpha"] == 16 and written["peft_type"] == "LORA"
  reference = peft_lib.PeftModel.from_pretrained(_hf(hf_base), str(tmp_path)).eval()
  tokens = _tokens(5, vocab=211)
  logits, _ = model(tokens)
  np.testing.assert_allclose(np.asarray(logits), _hf_logits(reference, tokens), atol=1e-5, rtol=0)
  # And back: our own file reads into the same adapters.
  again = load_model(hf_base, format="hf", lora=str(tmp_path))
  np.testing.assert_array_equal(np.asarray(again(tokens)[0]), np.asarray(logits))


def test_a_merged_model_saves_as_hugging_face_with_the_adapted_logits(hf_base, tmp_path):
  model = _randomise_adapters(lora.add_lora(load_model(hf_base, format="hf"), lora.LoraConfig(rank=4)), 11)
  with pytest.raises(ValueError, match="merge_lora"):
    save_hf(model, tmp_path / "unmerged")
  save_hf(lora.merge_lora(model), tmp_path / "merged")
  tokens = _tokens(6, vocab=211)
  np.testing.assert_allclose(_hf_logits(_hf(str(tmp_path / "merged")), tokens), np.asarray(model(tokens)[0]), atol=1e-5)


def test_an_adapter_of_another_shape_names_the_tensor_and_what_was_expected(hf_base, tmp_path):
  from helpers.hf_utils import save_tiny_hf_model

  other = tmp_path / "wider"
  save_tiny_hf_model(other, "qwen3", seed=1, head_dim=8, hidden_size=48)
  model = _randomise_adapters(lora.add_lora(load_model(str(other), format="hf"), lora.LoraConfig(rank=4)), 1)
  rj.save_lora(model, str(tmp_path / "adapter"))
  with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj\.lora_A\.weight.*\[4, 48\].*\[4, 32\]"):
    load_model(hf_base, format="hf", lora=str(tmp_path / "adapter"))


def test_peft_settings_this_loader_cannot_honour_are_named(hf_base, tmp_path):
  model = lora.add_lora(load_model(hf_base, format="hf"), lora.LoraConfig(rank=4))
  rj.save_lora(model, str(tmp_path))
  path = tmp_path / "adapter_config.json"
  written = json.loads(path.read_text())
  path.write_text(json.dumps(dict(written, rank_pattern={"q_proj": 8}, target_modules=["q_proj", "qkv"])))
  with pytest.raises(ValueError, match="rank_pattern"):
    load_model(hf_base, format="hf", lora=str(tmp_path))
  path.write_text(json.dumps(dict(written, target_modules=["q_proj", "qkv"])))
  with pytest.raises(ValueError, match="'qkv'.*gate_proj"):
    load_model(hf_base, format="hf", lora=str(tmp_path))


def test_decoding_with_adapters_unmerged_or_merged_gives_the_same_tokens():
  config = tiny(vocab_size=96, mask_token_id=95, eos_token_id=94, pad_token_id=0)
  model = _randomise_adapters(lora.add_lora(init_model(config, seed=8), lora.LoraConfig(rank=4, targets=ALL)), 2)
  prompts = [list(np.random.default_rng(i).integers(1, 90, 5 + i)) for i in range(3)]
  method = rj.ReFusion(gen_length=16, slot_size=4, serial_blocks=1, slot_threshold=0.5, token_threshold=0.3)
  unmerged = rj.decode(model, prompts, method)
  merged = rj.decode(lora.merge_lora(model), prompts, method)
  base = rj.decode(init_model(config, seed=8), prompts, method)
  assert [list(t) for t in unmerged.tokens] == [list(t) for t in merged.tokens]
  assert [list(t) for t in unmerged.tokens] != [list(t) for t in base.tokens]


# ------------------------------------------------------------------ training runs


def test_a_lora_run_resumes_exactly_and_saves_only_adapters(tmp_path, data_dir):
  config, straight, second = lora_run_straight_and_resumed(tmp_path, data_dir)
  assert sorted(second.losses) == [4, 5, 6]
  assert [second.losses[s] for s in (4, 5, 6)] == [straight.losses[s] for s in (4, 5, 6)]

  step_item = tmp_path / "resumed" / "checkpoints" / "6" / "params"
  names = orbax_tree.item_arrays(str(step_item))
  assert names and all("_lora." in name for name in names)
  with lora_run.Checkpoints(lora_run.base_directory(str(tmp_path / "resumed" / "checkpoints"))) as base:
    assert base.all_steps() == [0]

  straight_model, resumed_model = load_model(str(tmp_path / "straight")), load_model(str(tmp_path / "resumed"))
  assert lora.lora_config_of(resumed_model) == lora.LoraConfig(rank=4, dropout=0.1)
  for (path, a), (_, b) in zip(
    nnx.to_flat_state(nnx.state(straight_model)), nnx.to_flat_state(nnx.state(resumed_model))
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))

  config.lora.rank = 8
  with pytest.raises(ValueError, match="trained with lora=.*rank=4"):
    train.train_and_evaluate(config, str(tmp_path / "resumed"))


def test_unknown_lora_fields_are_refused_before_anything_runs(tmp_path, data_dir):
  config = smoke_config(data_dir)
  config.lora.rnak = 4
  with pytest.raises(ValueError, match="rnak"):
    train.train_and_evaluate(config, str(tmp_path))


def test_the_lora_command_line_path_trains_then_samples_and_evaluates(tmp_path, data_dir):
  workdir = str(tmp_path / "run")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  common = [f"--config.data.data_dir={data_dir}"]
  trained = subprocess.run(
    [sys.executable, "-m", "refusion_jax.train", "--config", "configs/demo.py:smoke", "--workdir", workdir]
    + common
    + ["--config.lora.rank=8", "--config.eval_every=0", "--config.num_train_steps=2"],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
  )
  assert trained.returncode == 0, trained.stderr[-3000:]
  model, tokenizer = load(workdir)
  assert lora.lora_config_of(model).rank == 8
  sampled = subprocess.run(
    [sys.executable, "-m", "refusion_jax.sample", "--checkpoint", workdir, "--prompt", "sort: 3 1 2"]
    + ["--gen_length", "8", "--slot_size", "4"],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
  )
  assert sampled.returncode == 0 and "answer:" in sampled.stdout, sampled.stderr[-3000:]
  out = tmp_path / "eval.json"
  evaluated = subprocess.run(
    [sys.executable, "-m", "refusion_jax.eval", "--checkpoint", workdir, "--config", "configs/demo.py:smoke"]
    + ["--num_examples=4", "--gen_length=16", "--slot_size=4", "--out", str(out), "--no_progress"],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
  )
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  assert "accuracy" in json.loads(out.read_text())["metrics"]


def test_train_bench_times_full_fine_tuning_against_lora():
  config = load_config("demo")
  timings = train_bench.time_objectives(config, ["refusion"], steps=1, lora_ranks=[0, 4])
  full, adapted = timings["refusion"], timings["refusion+lora4"]
  assert len(full.timing.rounds) == len(adapted.timing.rounds) == 1  # both timed, in the same round
  assert full.tokens == adapted.tokens and adapted.model_flops < full.model_flops
  # LoRA holds the frozen weights once, and Adam moments for the adapters only (full: weights and two moments).
  assert adapted.state_bytes < 0.5 * full.state_bytes


def test_convert_merges_a_peft_adapter_into_a_hugging_face_checkpoint(hf_base, tmp_path):
  from refusion_jax import convert

  model = _randomise_adapters(lora.add_lora(load_model(hf_base, format="hf"), lora.LoraConfig(rank=4)), 12)
  rj.save_lora(model, str(tmp_path / "adapter"))
  out = tmp_path / "merged"
  assert convert.main([hf_base, str(out), "--to", "hf", "--lora", str(tmp_path / "adapter")]) == 0
  tokens = _tokens(7, vocab=211)
  np.testing.assert_allclose(_hf_logits(_hf(str(out)), tokens), np.asarray(model(tokens)[0]), atol=1e-5)
  assert convert.main([hf_base, str(tmp_path / "again"), "--to", "peft", "--lora", str(tmp_path / "adapter")]) == 0
  again = load_model(hf_base, format="hf", lora=str(tmp_path / "again"))
  np.testing.assert_array_equal(np.asarray(again(tokens)[0]), np.asarray(model(tokens)[0]))
