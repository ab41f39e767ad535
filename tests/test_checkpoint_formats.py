"""Checkpoints of other JAX projects through the front door: tunix (real checkpoints and logits committed by
tests/make_tunix_fixtures.py), MaxText (written in its documented layout by tests/maxtext_layout.py), the
errors that name what does not fit, `inspect_checkpoint` and the convert CLI."""

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from closeness import relative_error
from flax import nnx
from hf_utils import hf_logits, save_tiny_hf_model
from maxtext_layout import maxtext_params, save_maxtext
from torch_reference import torch
from train_utils import smoke_config
from tunix_layout import save_tunix_layout

from refusion_jax import sample
from refusion_jax.checkpoints.export import convert, write_refusion
from refusion_jax.checkpoints.hf import config_to_hf, save_hf
from refusion_jax.checkpoints.load import inspect_checkpoint, load, load_model
from refusion_jax.data.tokenizer import ByteTokenizer
from refusion_jax.decoding.ar import ar_generate
from refusion_jax.model.config import ModelConfig
from refusion_jax.model.transformer import init_model
from refusion_jax.training.loop import train_and_evaluate
from refusion_jax.training.run_config import model_config_from

REPO = str(pathlib.Path(__file__).parent.parent)
TUNIX = pathlib.Path(__file__).parent / "fixtures" / "tunix"
TOLERANCE = 1e-5


def _tunix(family: str) -> tuple[ModelConfig, dict]:
  fixture = json.loads((TUNIX / family / "fixture.json").read_text())
  return ModelConfig(**fixture["model_config"]), dict(np.load(TUNIX / family / "reference.npz"))


def _logits(model, tokens, positions=None):
  positions = None if positions is None else jnp.asarray(positions, jnp.int32)
  return np.asarray(model(jnp.asarray(tokens), positions)[0])


def _random_tokens(vocab=211, shape=(2, 11)):
  return np.random.default_rng().integers(0, vocab, shape)


# ------------------------------------------------------------------- tunix


@pytest.mark.parametrize(
  "family, where",
  [("qwen3", "root"), ("qwen2", "step folder"), ("llama", "item folder")],
)
def test_tunix_checkpoint_reproduces_tunix_logits(family, where):
  config, reference = _tunix(family)
  path = {
    "root": TUNIX / family,
    "step folder": TUNIX / family / "3",
    "item folder": TUNIX / family / "3" / "model_params",
  }
  model = load_model(str(path[where]), config=config)
  ratio = relative_error(_logits(model, reference["tokens"], reference["positions"]), reference["logits"])
  print(f"\n[tunix parity] {family} ({where}): max|diff| / max|logit| = {ratio:.2e}")
  assert ratio <= TOLERANCE
  assert model.config.tie_embeddings == (family == "qwen2")


def test_tunix_without_a_config_asks_for_one():
  with pytest.raises(ValueError, match="does not store the model's config.*pass config="):
    load_model(str(TUNIX / "qwen3"))


def test_lora_only_tunix_checkpoint_is_refused_saying_so():
  with pytest.raises(ValueError, match=r"LoRA-only \(saved with save_only_lora_params=True\).*w_lora_a"):
    load_model(str(TUNIX / "lora"), config=_tunix("qwen3")[0])


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
  config, _ = _tunix("qwen3")
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


# ------------------------------------------------------------------- MaxText

MAXTEXT_CASES = {
  # family, scanned, padded vocabulary, Hugging Face config fields
  "qwen3_scanned_padded_vocab": ("qwen3", True, 256, dict(head_dim=16)),
  "qwen2_unscanned_tied": ("qwen2", False, None, dict(tie_word_embeddings=True)),
  "llama_scanned_gqa3": ("llama", True, None, dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=48)),
  "llama_unscanned_llama3_rope": (
    "llama",
    False,
    224,
    dict(
      rope_theta=500_000.0,
      rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=256
      ),
    ),
  ),
}


def _maxtext_case(tmp_path, case, **writer):
  family, scanned, padded, fields = MAXTEXT_CASES[case]
  hf_model = save_tiny_hf_model(tmp_path / "hf", family, seed=len(case), **fields)
  save_maxtext(tmp_path / "maxtext", maxtext_params(hf_model, scanned=scanned, padded_vocab=padded, **writer), step=4)
  return hf_model


@pytest.mark.parametrize("case", sorted(MAXTEXT_CASES))
def test_maxtext_checkpoint_matches_our_reference_and_transformers(case, tmp_path):
  hf_model = _maxtext_case(tmp_path, case)
  model = load_model(str(tmp_path / "maxtext"), config=str(tmp_path / "hf"))
  tokens = _random_tokens()
  positions = np.random.default_rng().integers(0, 1500, (2, 1)) + np.arange(tokens.shape[1])
  ours = _logits(model, tokens, positions)
  reference = _logits(load_model(tmp_path / "hf"), tokens, positions)
  ratio = relative_error(ours, reference)
  print(f"\n[maxtext parity] {case}: vs our HF load {ratio:.2e}", end="")
  assert ratio <= TOLERANCE
  # Through save_hf, transformers computes the logits of the original model.
  save_hf_dir = tmp_path / "exported"
  save_hf(model, save_hf_dir)
  exported = transformers.AutoModelForCausalLM.from_pretrained(
    save_hf_dir, dtype=torch.float32, attn_implementation="eager"
  ).eval()
  ratio = relative_error(hf_logits(exported, tokens, positions), hf_logits(hf_model, tokens, positions))
  print(f", exported vs transformers {ratio:.2e}")
  assert ratio <= TOLERANCE


def test_maxtext_scan_axis_that_does_not_match_is_named(tmp_path):
  _maxtext_case(tmp_path, "qwen3_scanned_padded_vocab", scan_axis=0)
  with pytest.raises(ValueError, match=r"layer axis at param_scan_axis=1.*embedding width is 32"):
    load_model(str(tmp_path / "maxtext"), config=str(tmp_path / "hf"))


def test_missing_and_unexpected_arrays_are_named_by_their_stored_name(tmp_path):
  hf_model = save_tiny_hf_model(tmp_path / "hf", "qwen2", seed=3)
  params = maxtext_params(hf_model, scanned=False)
  del params["decoder"]["layers_1"]["mlp"]["wo"]
  save_maxtext(tmp_path / "missing", params)
  with pytest.raises(ValueError, match=r"lacks 1 tensors.*params\.params\.decoder\.layers_1\.mlp\.wo\.kernel"):
    load_model(str(tmp_path / "missing"), config=str(tmp_path / "hf"))

  params = maxtext_params(hf_model, scanned=False)
  params["decoder"]["layers_0"]["mlp"]["wi_2"] = {"kernel": np.ones((32, 48), np.float32)}
  save_maxtext(tmp_path / "extra", params)
  with pytest.raises(ValueError, match=r"params\.params\.decoder\.layers_0\.mlp\.wi_2\.kernel has no counterpart"):
    load_model(str(tmp_path / "extra"), config=str(tmp_path / "hf"))


def test_inspect_reads_maxtext_without_its_optimizer_state(tmp_path):
  _maxtext_case(tmp_path, "qwen3_scanned_padded_vocab")
  info = inspect_checkpoint(str(tmp_path / "maxtext" / "4"))
  assert info.format == "maxtext" and not info.unknown
  assert not any(name.startswith("opt_state") for name in info.arrays)
  assert info.fields["padded_vocab"] == 256 and info.fields["num_layers"] == 2 and info.fields["head_dim"] == 16


# ------------------------------------------------------------------- converting


def test_convert_tunix_to_hf_gives_transformers_the_tunix_logits(tmp_path):
  config, reference = _tunix("qwen3")
  (tmp_path / "config").mkdir()
  (tmp_path / "config" / "config.json").write_text(json.dumps(config_to_hf(config)))
  done = convert(str(TUNIX / "qwen3"), str(tmp_path / "hf"), to="hf", config=str(tmp_path / "config"))
  assert "from the tunix checkpoint, step 3" in done
  exported = transformers.AutoModelForCausalLM.from_pretrained(
    tmp_path / "hf", dtype=torch.float32, attn_implementation="eager"
  ).eval()
  ratio = relative_error(hf_logits(exported, reference["tokens"], reference["positions"]), reference["logits"])
  assert ratio <= TOLERANCE


def test_convert_to_refusion_and_inspect(tmp_path):
  config, reference = _tunix("llama")
  shutil.copytree(TUNIX / "llama", tmp_path / "tunix")
  (tmp_path / "config").mkdir()
  (tmp_path / "config" / "config.json").write_text(json.dumps(config_to_hf(config)))
  convert(str(tmp_path / "tunix"), str(tmp_path / "run"), to="refusion", config=str(tmp_path / "config"))
  model, tokenizer = load(str(tmp_path / "run"))
  assert model.config == config
  assert relative_error(_logits(model, reference["tokens"], reference["positions"]), reference["logits"]) <= TOLERANCE

  out = convert(str(tmp_path / "run"), inspect=True)
  assert "format: refusion" in out and "layers.1.self_attn.q_proj.value  [16, 4, 8]" in out
  with pytest.raises(ValueError, match="Give SRC OUT --to hf|refusion"):
    convert(str(tmp_path / "run"), to="hf")


def test_convert_cli_reports_bad_input_in_one_line(tmp_path):
  argv = [sys.executable, "-m", "refusion_jax.convert", str(tmp_path), "--to", "hf"]
  out = subprocess.run(argv, capture_output=True, text=True)
  assert out.returncode == 2 and "Give SRC OUT --to hf|refusion" in out.stderr and "Traceback" not in out.stderr


# ------------------------------------------------------------------- straight onto a mesh

# Runs in a subprocess: the device count must be set before JAX initialises.
_ON_A_MESH = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_default_matmul_precision", "highest")
    import numpy as np
    from flax import nnx
    from refusion_jax.checkpoints.load import load_model
    from refusion_jax.model.config import ModelConfig
    from refusion_jax.model.transformer import abstract_model
    from refusion_jax.parallel import sharding

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    def rel(a, b):
      return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())
    report = {}
    for case in json.loads(open(sys.argv[1]).read()):
      config = case["config"] if not isinstance(case["config"], dict) else ModelConfig(**case["config"])
      reference = np.load(case["reference"])
      tokens, positions = reference["tokens"], reference["positions"].astype(np.int32)
      single = load_model(case["path"], config=config)
      sharded = load_model(case["path"], config=config, mesh=mesh)
      expected = sharding.state_shardings(abstract_model(single.config)[1], mesh)
      misplaced = [
        ".".join(map(str, path)) for (path, var), (_, want) in zip(
          nnx.to_flat_state(nnx.state(sharded)), nnx.to_flat_state(expected))
        if not var.get_value().sharding.is_equivalent_to(want.get_value(), var.get_value().ndim)
      ]
      one, many = np.asarray(single(tokens, positions)[0]), np.asarray(sharded(tokens, positions)[0])
      q = sharded.layers[0].self_attn.q_proj.get_value()
      report[case["name"]] = dict(
        single=rel(one, reference["logits"]), mesh=rel(many, reference["logits"]), mesh_vs_single=rel(many, one),
        misplaced=misplaced, q_shard=list(q.addressable_shards[0].data.shape), q_shape=list(q.shape),
        devices=len(q.sharding.device_set))
    print(json.dumps(report))
""")


def _reference_file(path, tokens, positions, logits) -> str:
  np.savez(path, tokens=tokens, positions=positions, logits=logits)
  return str(path)


def _mesh_case(tmp_path, fmt: str, family: str, tokens, positions) -> dict:
  """One checkpoint with the logits of its source project (tunix) or of the model its layout was written from
  (transformers for Hugging Face and MaxText, the same weights for ours)."""
  name, path = f"{fmt} {family}", tmp_path / f"{fmt}_{family}"
  if fmt == "tunix":
    config, reference = _tunix(family)
    reference_file = _reference_file(tmp_path / f"{fmt}_{family}.npz", **reference)
    return dict(name=name, path=str(TUNIX / family), config=dataclasses.asdict(config), reference=reference_file)
  hf_dir = tmp_path / f"hf_{family}"
  hf_model = save_tiny_hf_model(hf_dir, family, seed=5, vocab_size=96)
  reference_file = _reference_file(path.with_suffix(".npz"), tokens, positions, hf_logits(hf_model, tokens, positions))
  case = dict(name=name, path=str(hf_dir), config=None, reference=reference_file)
  if fmt == "maxtext":
    scanned, padded = {"qwen3": (True, 128), "qwen2": (False, None), "llama": (True, None)}[family]
    save_maxtext(path, maxtext_params(hf_model, scanned=scanned, padded_vocab=padded))
    case.update(path=str(path), config=str(hf_dir))
  elif fmt == "refusion":
    write_refusion(load_model(hf_dir), str(path), step=1, tokenizer=None)
    case.update(path=str(path))
  return case


def _run_on_a_mesh(tmp_path, pairs) -> dict:
  rng = np.random.default_rng()
  tokens = rng.integers(0, 96, (2, 9))
  positions = rng.integers(0, 1000, (2, 1)) + np.arange(9)
  cases = [_mesh_case(tmp_path, fmt, family, tokens, positions) for fmt, family in pairs]
  (tmp_path / "cases.json").write_text(json.dumps(cases))
  out = subprocess.run(
    [sys.executable, "-c", _ON_A_MESH, str(tmp_path / "cases.json")],
    capture_output=True,
    text=True,
    env=dict(os.environ, PYTHONPATH=REPO),
    cwd=REPO,
    timeout=900,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  report = json.loads(out.stdout.strip().splitlines()[-1])
  print("\n[mesh] case: rel. logit error vs reference on 1 device / on 8 devices (2x2x2), mesh vs 1 device")
  for name, row in report.items():
    print(f"[mesh] {name:18s} {row['single']:.1e} / {row['mesh']:.1e}, {row['mesh_vs_single']:.1e}")
  for name, row in report.items():
    assert row["devices"] == 8 and not row["misplaced"], (name, row)
    # q_proj [embed, heads, head_dim] really is split: embed over fsdp, heads over tensor.
    assert row["q_shard"] == [row["q_shape"][0] // 2, row["q_shape"][1] // 2, row["q_shape"][2]], (name, row)
    assert row["single"] <= TOLERANCE and row["mesh"] <= TOLERANCE and row["mesh_vs_single"] <= TOLERANCE, name
  return report


def test_every_format_lands_on_the_mesh_with_the_single_device_logits(tmp_path):
  # One family per format here (each family's layout is checked on one device above); all of them under -m slow.
  _run_on_a_mesh(tmp_path, [("tunix", "qwen2"), ("hf", "llama"), ("maxtext", "qwen3"), ("refusion", "qwen3")])


@pytest.mark.slow
def test_every_format_and_family_on_the_mesh(tmp_path):
  formats = ("tunix", "hf", "maxtext", "refusion")
  _run_on_a_mesh(tmp_path, [(fmt, family) for family in ("qwen3", "qwen2", "llama") for fmt in formats])


# ------------------------------------------------------------------- host memory


@pytest.mark.parametrize("fmt", ["hf", "tunix"])
def test_import_peaks_below_the_model_plus_two_of_its_largest_arrays(tmp_path, fmt):
  """A 173 MB model whose embedding (67 MB) is the largest array: any full host copy would add 173 MB.

  The ~1 GB measurement of the report: tests/memory_probe.py (its docstring has the command)."""
  probe = [sys.executable, os.path.join(REPO, "tests", "memory_probe.py")]
  run = dict(capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO, timeout=600)
  written = subprocess.run([*probe, "write", fmt, str(tmp_path / fmt), "256", "65536", "10"], **run)
  assert written.returncode == 0, written.stderr[-3000:]
  loaded = subprocess.run([*probe, "load", str(tmp_path / fmt)], **run)
  assert loaded.returncode == 0, loaded.stderr[-3000:]
  report = json.loads(loaded.stdout.strip().splitlines()[-1])
  budget = report["model_bytes"] + 2 * report["largest_bytes"]
  print(f"\n[memory] {fmt}: peak growth {report['growth'] / 1e6:.0f} MB, budget {budget / 1e6:.0f} MB")
  assert report["growth"] <= budget, report


# ------------------------------------------------------------------- entry points


def test_sample_cli_decodes_from_a_tunix_checkpoint(tmp_path, capsys):
  config, _ = _tunix("qwen3")
  config = config.replace(eos_token_id=47, pad_token_id=46)
  (tmp_path / "config").mkdir()
  (tmp_path / "config" / "config.json").write_text(json.dumps(config_to_hf(config)))
  argv = ["--checkpoint", TUNIX / "qwen3", "--model_config", tmp_path / "config", "--prompt_ids", "5,9,2"]
  assert sample.main([str(a) for a in [*argv, "--method", "ar", "--gen_length", 6, "--json"]]) == 0
  tokens = json.loads(capsys.readouterr().out)["tokens"]
  model = load_model(str(TUNIX / "qwen3"), config=config)
  assert tokens == ar_generate(model, [[5, 9, 2]], gen_length=6, eos_id=47, pad_id=46).tokens[0]
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
