"""The curated top-level API: every exported name resolves, and internals stay behind their module paths."""

import importlib

import pytest

import refusion_jax as rj

LIBRARY_PACKAGES = ("model", "checkpoints", "decoding", "training", "evaluation", "data", "parallel")


ENTRY_POINTS = ("train", "sample", "bench", "train_bench", "eval", "aot", "convert", "harness")


@pytest.mark.parametrize("name", rj.__all__)
def test_every_exported_name_is_the_object_its_module_defines(name):
  exported = getattr(rj, name)
  module = importlib.import_module(rj._EXPORTS[name])
  assert exported is getattr(module, name)
  assert callable(exported) and exported.__module__.startswith("refusion_jax.")


@pytest.mark.parametrize("old", ["load_checkpoint", "load_hf"])
def test_renamed_names_say_what_replaced_them(old):
  with pytest.raises(AttributeError, match=rf"refusion_jax.{old} was renamed: use refusion_jax.load_model"):
    getattr(rj, old)


def test_internals_are_not_exported():
  for internal in ("KVCache", "BlockKV", "decode_reference", "inference_view", "decode_loop"):
    assert internal not in rj.__all__
    with pytest.raises(AttributeError, match=internal):
      getattr(rj, internal)


# Which packages each library package may import: entry points -> training/decoding -> checkpoints/data ->
# model/parallel, never back up.
ALLOWED_IMPORTS = {
  "model": {"model", "parallel"},
  "parallel": {"parallel", "model"},
  "data": {"data", "model"},
  "checkpoints": {"checkpoints", "data", "model", "parallel"},
  "decoding": {"decoding", "data", "model", "parallel"},
  "training": {"training", "decoding", "checkpoints", "data", "model", "parallel"},
  "evaluation": {"evaluation", "training", "decoding", "checkpoints", "data", "model", "parallel"},
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
        if target not in allowed:
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
  assert {p.stem for p in root.glob("*.py")} == {"__init__", "cli", *ENTRY_POINTS}


def test_sub_packages_import_on_their_own():
  for package in LIBRARY_PACKAGES:
    importlib.import_module(f"refusion_jax.{package}")
