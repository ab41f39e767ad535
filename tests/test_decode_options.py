"""`decoding/options.py` (one `DecodeOptions` for every front door), the same flags in every command
(`cli.add_decode_flags`), the paper tasks merged with overrides (`paper.paper_method`) and the facts each shipped
method states about itself (`contract.MethodFacts`, `methods.register_method`)."""

import dataclasses

import numpy as np
import pytest

import refusion_jax as rj
from refusion_jax import cli
from refusion_jax import eval as eval_cli
from refusion_jax import sample as sample_cli
from refusion_jax import serve as serve_cli
from refusion_jax.decoding.methods import register_method
from refusion_jax.decoding.options import OPTION_NAMES, decode_options
from refusion_jax.decoding.result import PHASE_INFILL, PHASE_VERIFY, DecodeResult


def test_options_refuse_what_cannot_work_naming_the_field():
  for bad, message in (
    (dict(rows=0), "rows=0 must be a positive integer"),
    (dict(chunk_iterations=-1), "chunk_iterations=-1 must be a positive integer"),
    (dict(seed=1.5), "seed=1.5 must be an integer"),
    (dict(eos_id="2"), "eos_id='2' must be a token id"),
  ):
    with pytest.raises(ValueError, match=message):
      rj.DecodeOptions(**bad)


def test_keywords_are_the_options_fields_and_batch_size_is_read_as_rows_with_a_warning():
  base = rj.DecodeOptions(rows=2, seed=5)
  assert decode_options(base, dict(seed=7), "f") == rj.DecodeOptions(rows=2, seed=7)
  assert decode_options(None, {}, "f") == rj.DecodeOptions()
  with pytest.warns(DeprecationWarning, match=r"f\(\.\.\., batch_size=K\) is deprecated .* use f\(\.\.\., rows=K\)"):
    assert decode_options(None, dict(batch_size=4), "f").rows == 4
  with pytest.raises(TypeError, match="unexpected keyword.*slot_size.*rows, seed"):
    decode_options(None, dict(slot_size=4), "refusion_jax.decode")
  with pytest.raises(TypeError, match="give rows= only"):
    decode_options(None, dict(rows=2, batch_size=2), "f")


@pytest.mark.parametrize("command", [sample_cli, eval_cli, serve_cli])
def test_every_command_spells_the_options_alike(command):
  parser = command.build_parser()
  assert set(OPTION_NAMES) <= {action.dest for action in parser._actions}
  rng = np.random.default_rng()
  rows, seed = int(rng.integers(1, 9)), int(rng.integers(100))
  model = ["--checkpoint", "tiny"] if command is not sample_cli else ["--random_init", "tiny", "--prompt", "x"]
  args = parser.parse_args(
    [*model, "--rows", str(rows), "--seed", str(seed), "--eos_id", "3", "--chunk_iterations", "2"]
  )
  options = cli.decode_options(args)
  assert (options.rows, options.seed, options.eos_id, options.chunk_iterations) == (rows, seed, 3, 2)
  with pytest.warns(DeprecationWarning, match="--batch_size is deprecated .* use --rows"):
    assert parser.parse_args([*model, "--batch_size", "5"]).rows == 5
  with pytest.raises(cli.UsageError, match="rows=0"):
    cli.decode_options(parser.parse_args([*model, "--rows", "0"]))


def test_a_paper_task_merges_with_overrides_the_same_way_everywhere():
  task = rj.PAPER_TASKS["gsm8k_cot"]
  assert rj.paper_method("gsm8k_cot") == task
  short = rj.paper_method("gsm8k_cot", gen_length=64)  # S = 32: NB 4 does not split 2 slots, 2 does
  assert (short.gen_length, short.slot_size, short.serial_blocks) == (64, 32, 2)
  assert short.token_threshold == task.token_threshold
  assert rj.paper_method("gsm8k_cot", gen_length=64, serial_blocks=1, slot_threshold=None).serial_blocks == 1
  with pytest.raises(ValueError, match="not ReFusion's fields"):
    rj.paper_method("gsm8k_cot", steps=4)
  with pytest.raises(ValueError, match="not one of the paper's tasks"):
    rj.paper_method("gsm8k")
  args = serve_cli.build_parser().parse_args(
    ["--checkpoint", "tiny", "--paper_task", "gsm8k_cot", "--gen_length", "64"]
  )
  assert serve_cli.method_from_flags(args) == short  # the server takes what the harness takes


def test_the_shipped_methods_state_their_facts():
  refusion = rj.ReFusion(gen_length=64, slot_size=8, serial_blocks=2, slot_threshold=0.8, token_threshold=0.5)
  assert (refusion.label, refusion.answer_grid, refusion.token_grid) == ("refusion S8 0.8/0.5", 16, 8)
  assert refusion.resized(32) == dataclasses.replace(refusion, gen_length=32)
  assert rj.AR(gen_length=8).label == "ar" and rj.AR().answer_grid == rj.AR().token_grid == 1
  assert rj.AR(gen_length=8).resized(4) == rj.AR(gen_length=4)
  assert np.isnan(rj.AR().official_tpf(None, 0))
  mdm = rj.MDM(gen_length=64)
  assert mdm.label == "mdm B32 64 steps" and mdm.answer_grid == 32
  assert mdm.resized(16) == rj.MDM(gen_length=16, block_length=16, steps=16)


def test_refusions_official_tpf_averages_slots_over_each_cycles_forwards():
  # One answer of 8 tokens, S = 4: cycle 0 commits slot 0 by verification (2 forwards), cycle 1 slot 1 by infill
  # after 1 infill iteration (4 forwards). TPF = mean(4 / 2, 4 / 4) = 1.5.
  result = DecodeResult(
    tokens=[[1] * 8],
    num_forwards=np.array([1 + 2 * 2 + 2]),
    steps=np.array([2]),
    commit_iteration=np.array([[0, 0, 0, 0, 1, 1, 1, 1]]),
    commit_phase=np.array([[PHASE_VERIFY] * 4 + [PHASE_INFILL] * 4]),
  )
  assert rj.ReFusion(gen_length=8, slot_size=4).official_tpf(result, 0) == pytest.approx(1.5)


def test_register_method_refuses_what_is_no_method_and_a_taken_name():
  class NotFrozen:
    pass

  with pytest.raises(ValueError, match="NotFrozen lacks name"):
    register_method(NotFrozen)

  @dataclasses.dataclass(frozen=True)
  class Impostor(rj.AR):
    pass

  with pytest.raises(ValueError, match="A method named 'ar' is registered already"):
    register_method(Impostor)
