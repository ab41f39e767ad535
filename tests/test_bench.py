"""The decode benchmark reports every (method, batch) row; the throughput benchmark every mode with the same
tokens; the training benchmark times every objective."""

import dataclasses
import os
import subprocess
import sys
import types

import pytest
from helpers.train_utils import REPO, load_config

from refusion_jax.benchmarks import timer, train_step
from refusion_jax.benchmarks.decode import EAGER, DecodeBenchOptions, format_table, run_decode_bench, summary
from refusion_jax.benchmarks.quant import QuantBenchOptions, format_quant, run_quant_bench
from refusion_jax.benchmarks.throughput import (
  ThroughputOptions,
  different_from_sequential,
  format_throughput,
  run_throughput_bench,
)
from refusion_jax.decoding.mdm import MDM
from refusion_jax.decoding.refusion import ReFusion

ROWS = [("refusion", 1), (EAGER, 1), ("ar", 1), ("mdm", 1), ("refusion", 2), ("ar", 2), ("mdm", 2)]


def refusion_options(gen_length=8, serial_blocks=1):
  return ReFusion(gen_length, slot_size=4, serial_blocks=serial_blocks, slot_threshold=0.9, token_threshold=0.9)


def test_minimal_decode_bench_measures_every_method_and_batch():
  options = DecodeBenchOptions(refusion_options(), batch=2, repeats=1, mdm=MDM(8, block_length=8), sizes=("tiny",))
  rows = {(r.method, r.batch): r for r in run_decode_bench(options)}
  assert sorted(rows) == sorted(ROWS) and {r.model for r in rows.values()} == {"tiny"}
  assert rows[("ar", 1)].forwards == 8.0  # EOS is never predicted: 8 tokens, one forward each
  assert rows[("mdm", 1)].forwards == 8.0  # default steps = gen_length (one token per step)
  assert rows[("refusion", 1)].forwards == rows[(EAGER, 1)].forwards
  assert rows[("refusion", 1)].tokens == rows[(EAGER, 1)].tokens
  assert all(len(t) == 8 for r in rows.values() for t in r.tokens)
  assert rows[("mdm", 2)].kv_cache_bytes is None and rows[(EAGER, 1)].kv_cache_bytes is None  # no fixed cache
  assert rows[("refusion", 2)].kv_cache_bytes == 2 * rows[("refusion", 1)].kv_cache_bytes > 0
  assert all(r.run_s > 0 and r.timing.compile_seconds >= 0 and r.tokens_per_s > 0 for r in rows.values())
  # The formatters take the rows as they are; the table names the machine.
  table, text = format_table(list(rows.values())), summary(list(rows.values()))
  assert len(table.splitlines()) == 3 + len(ROWS) and "KiB" in table
  assert table.splitlines()[0] == f"machine: {timer.machine()}" and "CPU" in table.splitlines()[0]
  assert "(same tokens)" in text and "tokens/s at batch 2 over batch 1" in text


THROUGHPUT_MODES = ["sequential", "sequential, full width", "static 2", "continuous 1", "continuous 2"]


def test_throughput_bench_measures_every_mode_with_the_same_tokens():
  options = ThroughputOptions(refusion_options(), prompts=(3,), batch_sizes=(1, 2), repeats=1, num_layers=1)
  rows = run_throughput_bench(options)
  lines = {r.mode: r for r in rows}
  assert sorted(lines) == sorted(THROUGHPUT_MODES) and {r.prompts for r in rows} == {3}
  assert {mode: r.rows for mode, r in lines.items()} == {
    "sequential": 1,
    "sequential, full width": 1,
    "static 2": 2,
    "continuous 1": 1,
    "continuous 2": 2,
  }
  batch_forwards = {mode: r.batch_forwards for mode, r in lines.items()}
  assert lines["sequential, full width"].average_width == 8.0 and lines["sequential"].average_width <= 8.0
  # Two rows: fewer batched forwards than one by one; continuous no more than static batches.
  assert batch_forwards["continuous 2"] <= batch_forwards["static 2"] < batch_forwards["sequential"]
  # One row in one call: the forwards of one by one.
  assert batch_forwards["continuous 1"] == batch_forwards["sequential"]
  assert not different_from_sequential(rows) and all(len(r.tokens) == 3 for r in rows)
  assert "plan" in lines["continuous 2"].widths
  # The histograms are printed for the sequential run and the continuous runs of more than one row.
  report = format_throughput(rows)
  assert "forward widths (3 prompts, continuous 2)" in report
  assert "forward widths (3 prompts, continuous 1)" not in report


def test_bench_options_reject_bad_knobs():
  with pytest.raises(ValueError, match="multiple of slot_size"):
    refusion_options(gen_length=10)  # the method value checks itself
  with pytest.raises(ValueError, match="Unknown --random_init"):
    DecodeBenchOptions(refusion_options(), sizes=("tiny", "huge")).check()
  with pytest.raises(ValueError, match="at least 1"):
    ThroughputOptions(refusion_options(), prompts=(0,)).check()


def test_bench_cli_reports_bad_knobs_in_one_line():
  argv = [sys.executable, "-m", "refusion_jax.bench", "decode", "--gen_length", "10"]
  out = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO)
  assert out.returncode == 2 and "multiple of slot_size" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_default_decode_bench_on_tiny():
  options = DecodeBenchOptions(refusion_options(gen_length=64), sizes=("tiny",))
  rows = {(r.method, r.batch): r for r in run_decode_bench(options)}
  assert sorted(rows) == sorted([(m, b if b == 1 else 16) for m, b in ROWS])
  assert rows[("refusion", 1)].tokens == rows[(EAGER, 1)].tokens


def test_the_timer_warms_up_each_variant_then_interleaves_rounds(monkeypatch):
  now, order = [0.0], []
  monkeypatch.setattr(timer, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
  durations = {"a": iter([9.0, 1.0, 3.0, 2.0]), "b": iter([9.0, 2.0, 2.0, 8.0])}  # warm-up, then 3 rounds

  def variant(key):
    def call():
      order.append(key)
      now[0] += next(durations[key])
      return len(order)

    return call

  results, timings = timer.time_rounds({"a": variant("a"), "b": variant("b")}, repeats=3, progress=False)
  assert order == ["a", "b"] * 4 and results == {"a": 7, "b": 8}  # each variant's last result
  a = timings["a"]
  assert (a.warm_up, a.rounds, a.median, a.compile_seconds, a.spread) == (9.0, (1.0, 3.0, 2.0), 2.0, 7.0, 1.0)
  assert a.ratio_to(timings["b"]) == 0.5  # the median of same-round ratios 1/2, 3/2, 2/8
  with pytest.raises(ValueError, match="at least 1"):
    timer.time_rounds({"a": variant("a")}, repeats=0)


def test_train_bench_times_every_objective_in_interleaved_rounds(monkeypatch):
  # A clock whose n-th reading is n²: the k-th timed step lasts 4k + 1, so each objective's times say which
  # turns it had.
  readings = iter(n * n for n in range(100))
  monkeypatch.setattr(timer, "time", types.SimpleNamespace(perf_counter=lambda: float(next(readings))))
  config = load_config("demo")
  steps = train_step.time_objectives(config, ["ar", "refusion", "mdm"], steps=3)
  # A warm-up step each, then one step per objective per round, in turn: ar, refusion, mdm, ar, ...
  assert {kind: step.timing.warm_up for kind, step in steps.items()} == {"ar": 1.0, "refusion": 5.0, "mdm": 9.0}
  times = {kind: step.timing.rounds for kind, step in steps.items()}
  assert times == {"ar": (13.0, 25.0, 37.0), "refusion": (17.0, 29.0, 41.0), "mdm": (21.0, 33.0, 45.0)}
  # ReFusion and AR train on the same packed rows; MDM cannot pack, so it gets rows of one example each.
  assert steps["ar"].tokens == steps["refusion"].tokens and steps["ar"].model_flops > 0
  assert steps["refusion"].pad_fraction < steps["mdm"].pad_fraction


@pytest.mark.parametrize("packing", [True, False])
def test_synthetic_batch_has_the_training_layout(packing):
  batch = train_step.synthetic_batch(4, 512, pad_id=300, packing=packing, max_segments=6, seed=1)
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


def test_the_quantization_bench_compares_every_variant_with_bfloat16_on_one_draw():
  options = QuantBenchOptions(preset="tiny", count=4, length=16, gen_length=8, repeats=1, variants="int8,int4 g32")
  rows, source = run_quant_bench(options)
  rows = {row.name: row for row in rows}
  assert sorted(rows) == ["bfloat16", "float32", "int4 g32", "int8"] and "tiny" in source
  reference = rows["bfloat16"]
  assert reference.error_vs_reference == 0 and reference.top1 == 1 and reference.greedy_agreement == 1
  # One draw cast and quantized: bfloat16 is near float32, int8 near bfloat16, int4 further away.
  assert 0 < rows["float32"].error_vs_reference < 0.02 and 0 < rows["int8"].error_vs_reference < 0.05
  assert rows["int4 g32"].error_vs_reference > rows["int8"].error_vs_reference
  sizes = [rows[name].param_bytes for name in ("float32", "bfloat16", "int8", "int4 g32")]
  assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 4
  assert all(row.seconds_per_forward > 0 for row in rows.values())
  table = format_quant(list(rows.values()), source)
  assert table.count("\n| ") == 2 + len(rows) and "1.00x" in table and "KiB" in table and timer.machine() in table
  with pytest.raises(ValueError, match="Unknown variants"):
    run_quant_bench(dataclasses.replace(options, variants="int3"))


def test_every_mode_names_a_random_model_as_every_command_does_and_the_old_flags_warn():
  from refusion_jax import bench

  parser = bench.build_parser()
  for mode in ("decode", "throughput", "lora", "quant"):
    assert parser.parse_args([mode, "--random_init", "small"]).random_init == "small"
  for argv, new in (
    (["decode", "--sizes", "tiny"], "--random_init"),
    (["throughput", "--size", "tiny"], "--random_init"),
    (["lora", "--preset", "tiny"], "--random_init"),
    (["quant", "--preset", "tiny"], "--random_init"),
    (["quant", "--seed", "7"], "--init_seed"),
    (["throughput", "--seed", "7"], "--init_seed"),
  ):
    with pytest.warns(DeprecationWarning, match=f"the flag {argv[1]} is deprecated .* use {new}"):
      args = parser.parse_args(argv)
    assert getattr(args, new.lstrip("-")) == (7 if new == "--init_seed" else "tiny")
  options = bench._fields(
    bench.QuantBenchOptions, parser.parse_args(["quant", "--random_init", "tiny", "--init_seed", "3"])
  )
  assert (options["preset"], options["seed"]) == ("tiny", 3)
