"""The curated top-level API: every exported name resolves, and internals stay behind their module paths."""

import importlib

import jax
import numpy as np
import pytest
from flax import nnx

import refusion_jax as rj

LIBRARY_PACKAGES = ("model", "checkpoints", "decoding", "training", "evaluation", "serving", "data", "parallel")


ENTRY_POINTS = ("train", "sample", "bench", "train_bench", "eval", "aot", "convert", "harness", "serve")


@pytest.mark.parametrize("name", rj.__all__)
def test_every_exported_name_is_the_object_its_module_defines(name):
  exported = getattr(rj, name)
  module = importlib.import_module(rj._EXPORTS[name])
  assert exported is getattr(module, name)
  if name == "PAPER_TASKS":  # the one exported table: method values
    assert all(isinstance(value, rj.ReFusion) for value in exported.values())
    return
  assert callable(exported) and exported.__module__.startswith("refusion_jax.")


def test_renamed_loaders_still_work_and_say_what_replaced_them(tmp_path):
  from refusion_jax.checkpoints.hf import save_hf
  from refusion_jax.model.transformer import init_model

  seed = int(np.random.default_rng().integers(1 << 16))
  saved = init_model(rj.preset("tiny", num_layers=1), seed)
  save_hf(saved, tmp_path)
  with pytest.warns(
    DeprecationWarning, match=r"refusion_jax.load_checkpoint is deprecated .* use refusion_jax.load_model"
  ):
    load_checkpoint = rj.load_checkpoint
  assert load_checkpoint is rj.load_model
  with pytest.warns(DeprecationWarning, match=r"removed in 0.3: use refusion_jax.load_model\(path, format=\"hf\""):
    load_hf = rj.load_hf
  # The 0.1 signature: dtype positional, config_overrides for config.json's fields.
  model = load_hf(str(tmp_path), "bfloat16", config_overrides=dict(rms_norm_eps=1e-5))
  assert (model.config.dtype, model.config.param_dtype, model.config.rms_norm_eps) == ("bfloat16", "bfloat16", 1e-5)
  expected = rj.load_model(str(tmp_path), dtype="bfloat16")
  for got, want in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(expected))):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=f"seed {seed}")


def test_internals_are_not_exported():
  for internal in ("KVCache", "BlockKV", "decode_reference", "inference_view", "decode_loop"):
    assert internal not in rj.__all__
    with pytest.raises(AttributeError, match=internal):
      getattr(rj, internal)


# Which packages each library package may import: entry points -> evaluation -> serving -> training/decoding ->
# checkpoints/data -> model/parallel, never back up.
ALLOWED_IMPORTS = {
  "model": {"model", "parallel"},
  "parallel": {"parallel", "model"},
  "data": {"data", "model"},
  "checkpoints": {"checkpoints", "data", "model", "parallel"},
  "decoding": {"decoding", "data", "model", "parallel"},
  "training": {"training", "decoding", "checkpoints", "data", "model", "parallel"},
  "serving": {"serving", "decoding", "data", "model", "parallel"},
  "evaluation": {"evaluation", "serving", "training", "decoding", "checkpoints", "data", "model", "parallel"},
}


def test_imports_run_one_way():
  import pathlib
  import re

  root = pathlib.Path(rj.__file__).parent
  pattern = re.compile(r"(?:from|import) refusion_jax\.(\w+)|from refusion_jax import (\w+)")
  offenders = []
  for package, allowed in ALLOWED_IMPORTS.items():
    for path in (root / package).glob("*.py"):
      for match in pattern.finditer(path.read_text(encoding="utf-8")):
        target = match.group(1) or match.group(2)
        if target not in allowed and target != "deprecation":  # the old-names helper imports nothing
          offenders.append(f"{package}/{path.name} imports refusion_jax.{target}")
  assert not offenders, offenders
  assert set(ALLOWED_IMPORTS) == set(LIBRARY_PACKAGES)


def test_no_module_imports_an_entry_point():
  import pathlib
  import re

  root = pathlib.Path(rj.__file__).parent
  names = "|".join(ENTRY_POINTS)
  pattern = re.compile(rf"(?:from|import) refusion_jax\.({names})\b|from refusion_jax import .*\b({names})\b")
  offenders = [
    f"{path.relative_to(root)} imports refusion_jax.{match.group(1) or match.group(2)}"
    for path in root.rglob("*.py")
    for match in pattern.finditer(path.read_text(encoding="utf-8"))
  ]
  assert not offenders, offenders
  assert {p.stem for p in root.glob("*.py")} == {"__init__", "cli", "deprecation", *ENTRY_POINTS}


def test_sub_packages_import_on_their_own():
  for package in LIBRARY_PACKAGES:
    importlib.import_module(f"refusion_jax.{package}")


# Every renamed decoding name: (module, old name, what the warning names, the object it must give).
def _renamed_decoding_names():
  from refusion_jax.decoding import batching, driver, mdm, mesh, methods, refusion

  return [
    ("batching", "Batch", "batching.LoopState", batching.LoopState),
    ("mdm", "MDMSchedule", "mdm.MDMSettings", mdm.MDMSettings),
    ("mesh", "batch_shardings", "mesh.loop_shardings", mesh.loop_shardings),
    ("refusion", "REFUSION", "refusion.ReFusion", refusion.ReFusion),
    ("refusion", "picks_rows", "driver.pick_rows_on", driver.pick_rows_on),
    ("refusion", "pick_rows_on", "driver.pick_rows_on", driver.pick_rows_on),
    ("driver", "Placement", "driver.LoopPlacement", driver.LoopPlacement),
    ("driver", "start_batch", "driver.start_state", driver.start_state),
    ("sampler", "METHODS", "methods.METHODS", methods.METHODS),
    ("defaults", "MDM_BLOCK_LENGTH", "mdm.MDM_BLOCK_LENGTH", mdm.MDM_BLOCK_LENGTH),
  ]


@pytest.mark.parametrize("index", range(10))
def test_every_renamed_decoding_name_warns_naming_its_replacement_and_works(index):
  module, old, new, value = _renamed_decoding_names()[index]
  decoding = importlib.import_module(f"refusion_jax.decoding.{module}")
  with pytest.warns(DeprecationWarning, match=rf"refusion_jax.decoding.{module}.{old} is deprecated .*{new}"):
    assert getattr(decoding, old) is value


def test_the_old_decode_defaults_warn_and_equal_the_method_classes_defaults():
  from refusion_jax.decoding import defaults, sampler

  with pytest.warns(DeprecationWarning, match="refusion_jax.ReFusion"):
    assert defaults.GEN_LENGTH == rj.ReFusion().gen_length
  with pytest.warns(DeprecationWarning, match="ReFusion"):
    assert defaults.REFUSION_KNOBS == dict(slot_size=4, serial_blocks=1, slot_threshold=0.9, token_threshold=0.9)
  with pytest.warns(DeprecationWarning, match="ReFusion"):
    assert defaults.REFUSION == defaults.REFUSION_KNOBS
  with pytest.warns(DeprecationWarning, match=r"MDM\(gen_length=G\)"):
    assert (defaults.mdm_block_length(48), defaults.mdm_steps(48)) == (32, 48)
  with pytest.warns(DeprecationWarning, match="method_value"):
    assert defaults.method_defaults("mdm", 16) == dict(gen_length=16, block_length=16, steps=16)
  with pytest.warns(DeprecationWarning, match="method_value"):
    assert defaults.method_defaults("refusion") == dict(
      gen_length=64, slot_size=4, serial_blocks=1, slot_threshold=0.9, token_threshold=0.9
    )
  with pytest.warns(DeprecationWarning, match="dataclasses.fields"):
    assert sampler.decoder_options(rj.AR) == ["gen_length", "temperature"]


def test_the_renamed_evaluation_names_warn_and_work():
  import ml_collections

  from refusion_jax import eval as eval_cli
  from refusion_jax.evaluation import bench_models, harness
  from refusion_jax.training import validation

  section = ml_collections.ConfigDict(dict(gen_length=16, slot_size=8, mdm_block_length=8, mdm_steps=8))
  with pytest.warns(DeprecationWarning, match="config_method"):
    assert validation.eval_knobs("mdm", section) == dict(gen_length=16, block_length=8, steps=8)
  with pytest.warns(DeprecationWarning, match="config_method"):
    assert validation.EVAL_KNOBS["steps"] == "mdm_steps"
  with pytest.warns(DeprecationWarning, match="harness.REFUSION_FIELDS"):
    assert harness.REFUSION_KNOBS == harness.REFUSION_FIELDS
  with pytest.warns(DeprecationWarning, match="paper.PAPER_GEN_LENGTH"):
    assert harness.PAPER_GEN_LENGTH == 512
  with pytest.warns(DeprecationWarning, match=r"refusion_jax.ReFusion \(same fields"):
    assert bench_models.ReFusionOptions(32, 8, 2, 0.9, 0.5) == rj.ReFusion(32, 8, 2, 0.9, 0.5)
  with pytest.warns(DeprecationWarning, match="evaluation.sweep.default_label"):
    assert eval_cli.default_label("mdm", dict(gen_length=16, steps=8)) == "mdm B16 8 steps"
