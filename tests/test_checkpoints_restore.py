"""checkpoints/restore.py: every format's parameters restored straight onto a mesh, and loading without a full
host copy of the model."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers.checkpoint_cases import (
  TOLERANCE,
  TUNIX,
  tunix_case,
)
from helpers.hf_utils import hf_logits, save_tiny_hf_model
from helpers.maxtext_layout import maxtext_params, save_maxtext

from refusion_jax.checkpoints.export import write_refusion
from refusion_jax.checkpoints.load import load_model

REPO = str(pathlib.Path(__file__).parent.parent)

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
    config, reference = tunix_case(family)
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

  The ~1 GB measurement of the report: tests/helpers/memory_probe.py (its docstring has the command)."""
  probe = [sys.executable, os.path.join(REPO, "tests", "helpers", "memory_probe.py")]
  run = dict(capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO, timeout=600)
  written = subprocess.run([*probe, "write", fmt, str(tmp_path / fmt), "256", "65536", "10"], **run)
  assert written.returncode == 0, written.stderr[-3000:]
  loaded = subprocess.run([*probe, "load", str(tmp_path / fmt)], **run)
  assert loaded.returncode == 0, loaded.stderr[-3000:]
  report = json.loads(loaded.stdout.strip().splitlines()[-1])
  budget = report["model_bytes"] + 2 * report["largest_bytes"]
  print(f"\n[memory] {fmt}: peak growth {report['growth'] / 1e6:.0f} MB, budget {budget / 1e6:.0f} MB")
  assert report["growth"] <= budget, report
