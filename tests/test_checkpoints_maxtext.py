"""MaxText checkpoints, written in MaxText's documented layout by tests/helpers/maxtext_layout.py, through the
front door: against our reference and transformers, scanned or not, padded vocabularies, misfits named."""

import pathlib

import numpy as np
import pytest
import transformers
from helpers.checkpoint_cases import (
  MAXTEXT_CASES,
  TOLERANCE,
  logits,
  maxtext_case,
  random_tokens,
)
from helpers.closeness import relative_error
from helpers.hf_utils import hf_logits, save_tiny_hf_model
from helpers.maxtext_layout import maxtext_params, save_maxtext
from helpers.torch_reference import torch

from refusion_jax.checkpoints.hf import save_hf
from refusion_jax.checkpoints.load import inspect_checkpoint, load_model

REPO = str(pathlib.Path(__file__).parent.parent)

# ------------------------------------------------------------------- MaxText


@pytest.mark.parametrize("case", sorted(MAXTEXT_CASES))
def test_maxtext_checkpoint_matches_our_reference_and_transformers(case, tmp_path):
  hf_model = maxtext_case(tmp_path, case)
  model = load_model(str(tmp_path / "maxtext"), config=str(tmp_path / "hf"))
  tokens = random_tokens()
  positions = np.random.default_rng().integers(0, 1500, (2, 1)) + np.arange(tokens.shape[1])
  ours = logits(model, tokens, positions)
  reference = logits(load_model(tmp_path / "hf"), tokens, positions)
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
  maxtext_case(tmp_path, "qwen3_scanned_padded_vocab", scan_axis=0)
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
  maxtext_case(tmp_path, "qwen3_scanned_padded_vocab")
  info = inspect_checkpoint(str(tmp_path / "maxtext" / "4"))
  assert info.format == "maxtext" and not info.unknown
  assert not any(name.startswith("opt_state") for name in info.arrays)
  assert info.fields["padded_vocab"] == 256 and info.fields["num_layers"] == 2 and info.fields["head_dim"] == 16
