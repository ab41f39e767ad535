"""checkpoints/export.py: converting a checkpoint of any format to Hugging Face or to a run directory."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import transformers
from helpers.checkpoint_cases import (
  TOLERANCE,
  TUNIX,
  logits,
  tunix_case,
)
from helpers.closeness import relative_error
from helpers.hf_utils import hf_logits
from helpers.torch_reference import torch

from refusion_jax.checkpoints.export import convert
from refusion_jax.checkpoints.hf import config_to_hf
from refusion_jax.checkpoints.load import load

REPO = str(pathlib.Path(__file__).parent.parent)

# ------------------------------------------------------------------- converting


def test_convert_tunix_to_hf_gives_transformers_the_tunix_logits(tmp_path):
  config, reference = tunix_case("qwen3")
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
  config, reference = tunix_case("llama")
  shutil.copytree(TUNIX / "llama", tmp_path / "tunix")
  (tmp_path / "config").mkdir()
  (tmp_path / "config" / "config.json").write_text(json.dumps(config_to_hf(config)))
  convert(str(tmp_path / "tunix"), str(tmp_path / "run"), to="refusion", config=str(tmp_path / "config"))
  model, tokenizer = load(str(tmp_path / "run"))
  assert model.config == config
  assert relative_error(logits(model, reference["tokens"], reference["positions"]), reference["logits"]) <= TOLERANCE

  out = convert(str(tmp_path / "run"), inspect=True)
  assert "format: refusion" in out and "layers.1.self_attn.q_proj.value  [16, 4, 8]" in out
  with pytest.raises(ValueError, match="Give SRC OUT --to hf|refusion"):
    convert(str(tmp_path / "run"), to="hf")


def test_convert_cli_reports_bad_input_in_one_line(tmp_path):
  argv = [sys.executable, "-m", "refusion_jax.convert", str(tmp_path), "--to", "hf"]
  env = dict(os.environ, PYTHONPATH=REPO)  # this checkout's package, wherever pytest runs from
  out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO)
  assert out.returncode == 2 and "Give SRC OUT --to hf|refusion" in out.stderr and "Traceback" not in out.stderr
