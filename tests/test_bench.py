"""The decode benchmark reports every (method, batch) row; the training benchmark times every objective."""

import re
import types

import pytest
from train_utils import load_config

from refusion_jax import bench, train_bench

ROWS = [("refusion", 1), ("refusion eager ref.", 1), ("ar", 1), ("mdm", 1), ("refusion", 2), ("ar", 2), ("mdm", 2)]


def table_rows(out, model):
  """(method, batch) -> the numeric cells of each table line of `model`."""
  rows = {}
  for line in out.splitlines():
    match = re.match(rf"{model}\s+(\S+(?: \S+)*?)\s+(\d+)\s+(.*)$", line)
    if match:
      rows[(match.group(1), int(match.group(2)))] = match.group(3).split()
  return rows


def test_minimal_bench_reports_every_row(capsys):
  code = bench.main(
    ["decode", "--sizes", "tiny", "--batch", "2", "--gen_length", "8", "--repeats", "1", "--mdm_block_length", "8"]
  )
  out, err = capsys.readouterr()
  assert code == 0, err
  rows = table_rows(out, "tiny")
  assert sorted(rows) == sorted(ROWS)
  forwards = {key: float(cells[0]) for key, cells in rows.items()}
  assert forwards[("ar", 1)] == 8.0  # EOS is never predicted: 8 tokens, one forward each
  assert forwards[("mdm", 1)] == 8.0  # default steps = gen_length (one token per step)
  assert forwards[("refusion", 1)] == forwards[("refusion eager ref.", 1)]
  assert rows[("mdm", 2)][-1] == "-" and rows[("refusion eager ref.", 1)][-1] == "-"  # no fixed cache
  one, two = rows[("refusion", 1)][-2:], rows[("refusion", 2)][-2:]
  assert one[1] == two[1] == "KiB" and float(two[0]) == pytest.approx(2 * float(one[0]))
  assert "(same tokens)" in out
  assert "first call" in err  # progress lines
  assert "reproduce with: python -m refusion_jax.bench decode --sizes tiny" in out


THROUGHPUT_MODES = ["sequential", "sequential, full width", "static 2", "continuous 1", "continuous 2"]


def test_throughput_bench_reports_every_mode_with_the_same_tokens(capsys):
  argv = ["throughput", "--prompts", "3", "--batch_sizes", "1,2", "--num_layers", "1", "--gen_length", "8"]
  code = bench.main([*argv, "--serial_blocks", "1", "--repeats", "1"])
  out, err = capsys.readouterr()
  assert code == 0, err
  # prompts, mode, K, fwd/answer, batch fwds, avg width, tokens/s, run s, vs sequential
  cells = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines() if re.match(r"3\s{2,}\S", line)]
  lines = {row[1]: row for row in cells}
  assert sorted(lines) == sorted(THROUGHPUT_MODES)
  assert lines["sequential"][-1] == "1.00x"
  batch_forwards = {mode: int(row[4]) for mode, row in lines.items()}
  widths = {mode: float(row[5]) for mode, row in lines.items()}
  assert widths["sequential, full width"] == 8.0 and widths["sequential"] <= 8.0
  # Two rows: fewer batched forwards than one by one; continuous no more than static batches.
  assert batch_forwards["continuous 2"] <= batch_forwards["static 2"] < batch_forwards["sequential"]
  # One row in one call: the forwards of one by one, and its histogram is the sequential one (not repeated).
  assert batch_forwards["continuous 1"] == batch_forwards["sequential"]
  assert "forward widths (3 prompts, continuous 1)" not in out
  assert "every mode: the same tokens." in out
  assert re.search(r"^  plan\s+\d", out, re.M) and "forward widths (3 prompts, continuous 2)" in out
  assert "reproduce with: python -m refusion_jax.bench throughput --prompts 3" in out


def test_bench_rejects_bad_knobs(capsys):
  assert bench.main(["decode", "--gen_length", "10"]) == 2
  assert "multiple of slot_size" in capsys.readouterr().err
  assert bench.main(["decode", "--sizes", "tiny,huge"]) == 2
  assert "Unknown --sizes" in capsys.readouterr().err


@pytest.mark.slow
def test_default_bench_on_tiny(capsys):
  assert bench.main(["decode", "--sizes", "tiny"]) == 0
  out, _ = capsys.readouterr()
  rows = table_rows(out, "tiny")
  assert sorted(rows) == sorted([(m, b if b == 1 else 16) for m, b in ROWS])
  assert "(same tokens)" in out


def test_train_bench_times_every_objective_in_interleaved_rounds(monkeypatch):
  # A clock whose n-th reading is n²: the k-th timed step lasts 4k + 1, so each objective's times say which
  # turns it had.
  readings = iter(n * n for n in range(100))
  monkeypatch.setattr(train_bench, "time", types.SimpleNamespace(perf_counter=lambda: float(next(readings))))
  config = load_config("demo")
  timings = train_bench.time_objectives(config, ["ar", "refusion", "mdm"], steps=3)
  # One step per objective per round, in turn: ar, refusion, mdm, ar, ...
  times = {kind: timing.seconds for kind, timing in timings.items()}
  assert times == {"ar": [1.0, 13.0, 25.0], "refusion": [5.0, 17.0, 29.0], "mdm": [9.0, 21.0, 33.0]}
  # ReFusion and AR train on the same packed rows; MDM cannot pack, so it gets rows of one example each.
  assert timings["ar"].tokens == timings["refusion"].tokens and timings["ar"].model_flops > 0
  assert timings["refusion"].pad_fraction < timings["mdm"].pad_fraction


@pytest.mark.parametrize("packing", [True, False])
def test_synthetic_batch_has_the_training_layout(packing):
  batch = train_bench.synthetic_batch(4, 512, pad_id=300, packing=packing, max_segments=6, seed=1)
  assert batch["tokens"].shape == (4, 512)
  assert batch["prompt_len"].shape == ((4, 6) if packing else (4,)) == batch["answer_len"].shape
  lengths = (batch["prompt_len"] + batch["answer_len"]).reshape(4, -1).sum(axis=1)
  assert (lengths <= 512).all() and (lengths > 0).all()
  for row, used in zip(batch["tokens"], lengths):
    assert (row[:used] < 256).all() and (row[used:] == 300).all()


def test_recipe_config_takes_a_layer_count_for_benchmarks(monkeypatch):
  import pathlib
  import sys

  from absl import flags
  from ml_collections import config_flags

  from refusion_jax.data.tokenizer import load_tokenizer
  from refusion_jax.training.run_config import model_config_from

  path = pathlib.Path(__file__).parents[1] / "configs" / "refusion_qwen3_8b.py"
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=values, lock_config=True)
  argv = ["train_bench", f"--config={path}", "--config.model.num_layers=8"]
  monkeypatch.setattr(sys, "argv", argv)  # config_flags reads the overrides from sys.argv
  values(argv)
  short = model_config_from(values.config, load_tokenizer("bytes"))
  full = model_config_from(load_config("refusion_qwen3_8b", variant=""), load_tokenizer("bytes"))
  assert (full.num_layers, short.num_layers) == (36, 8)
  assert short.replace(num_layers=36) == full
