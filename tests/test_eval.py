"""The evaluation command, its metrics and the report, on a random tiny model (seconds)."""

import json
import os
import random
import types

import numpy as np
import pytest
from helpers.decode_cases import byte_model
from helpers.train_utils import REPO

import refusion_jax as rj
from refusion_jax import eval as eval_cli
from refusion_jax.benchmarks import timer
from refusion_jax.checkpoints import export
from refusion_jax.checkpoints import hf as hf_io
from refusion_jax.data.tasks import TASKS, check_answer, generate_examples
from refusion_jax.data.tokenizer import ByteTokenizer
from refusion_jax.evaluation import report, runner
from refusion_jax.training.config_file import RUN_CONFIG_FILE, load_config, write_run_config

TOK = ByteTokenizer()
SMOKE = os.path.join(REPO, "configs", "demo.py") + ":smoke"


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
  """A random tiny byte-level model and the Hugging Face directory it is saved in."""
  model = byte_model(3)
  path = tmp_path_factory.mktemp("hf")
  hf_io.save_hf(model, path)
  return model, str(path)


def run_cli(capsys, *argv):
  code = eval_cli.main([str(a) for a in argv])
  out, err = capsys.readouterr()
  return code, out, err


def write_json(path, records):
  path.write_text(json.dumps(records))
  return str(path)


# ------------------------------------------------------------------ batching and timing


def test_task_batches_never_mix_tasks_and_cover_every_example():
  rng = random.Random(7)
  examples = [{"task": rng.choice(TASKS), "query": str(i)} for i in range(rng.randint(20, 60))]
  batch_size = rng.randint(1, 9)
  batches = runner.task_batches(examples, batch_size)
  assert sorted(i for rows in batches for i in rows) == list(range(len(examples)))
  for rows in batches:
    assert 1 <= len(rows) <= batch_size
    assert len({examples[i]["task"] for i in rows}) == 1
  full = [rows for rows in batches if len(rows) < batch_size]
  assert len(full) <= len({e["task"] for e in examples})  # at most one short batch per task


@pytest.mark.parametrize("repeats", [1, 3])
def test_timed_decode_reruns_only_calls_that_compiled(monkeypatch, repeats):
  compiled = [0]
  calls = []
  now = [0.0]
  monkeypatch.setattr(timer, "compilations", lambda: compiled[0])
  monkeypatch.setattr(timer, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

  def call(compiles: bool):
    # A run takes 1 s plus 0.5 s per earlier call; compiling, 5 s more.
    now[0] += 1.0 + 0.5 * len(calls) + (5.0 if compiles and not calls else 0.0)
    calls.append(compiles)
    if compiles and len(calls) == 1:
      compiled[0] += 1
    return len(calls)

  result, run_seconds, compile_seconds = runner.timed_decode(lambda: call(True), repeats)
  assert len(calls) == 1 + repeats and result == 1 + repeats  # the compiling call is not a measured run
  # The compiling call took 6 s, the runs 1.5, 2 and 2.5 s: the median is reported, compilation the difference.
  assert run_seconds == 1.0 + 0.5 * (repeats + 1) / 2 and compile_seconds == 6.0 - run_seconds
  calls.clear()
  result, run_seconds, compile_seconds = runner.timed_decode(lambda: call(False), repeats)
  assert len(calls) == repeats and result == repeats and compile_seconds == 0.0
  assert run_seconds == 1.0 + 0.5 * (repeats - 1) / 2  # the first call is the first run


def test_summary_metrics_per_task():
  rng = np.random.default_rng(5)
  answers, batches = [], []
  for task in ("sort", "lookup"):
    for _ in range(int(rng.integers(3, 8))):
      answers.append(
        runner.Answer(
          task=task,
          query="q",
          reference="r",
          answer="a",
          correct=bool(rng.integers(2)),
          num_tokens=int(rng.integers(1, 20)),
          num_forwards=int(rng.integers(1, 10)),
        )
      )
    seconds, forwards = float(rng.uniform(0.1, 1)), int(rng.integers(5, 20))
    batches.append(runner.BatchTiming(task=task, rows=1, seconds=seconds, forwards=forwards, compile_seconds=2.0))
  metrics = runner.summarize(runner.EvalRun(answers=answers, batches=batches))
  tokens = sum(a.num_tokens for a in answers)
  seconds = sum(b.seconds for b in batches)
  assert metrics["accuracy"] == pytest.approx(np.mean([a.correct for a in answers]))
  assert metrics["tpf"] == pytest.approx(tokens / sum(a.num_forwards for a in answers))
  assert metrics["tokens_per_s"] == pytest.approx(tokens / seconds)
  assert metrics["compile_s"] == 4.0
  assert metrics["seconds_per_forward"] == pytest.approx(seconds / sum(b.forwards for b in batches))
  for task, batch in zip(("sort", "lookup"), batches):
    mine = [a for a in answers if a.task == task]
    group = metrics["by_task"][task]
    assert group["count"] == len(mine)
    assert group["accuracy"] == pytest.approx(np.mean([a.correct for a in mine]))
    assert group["mean_forwards"] == pytest.approx(np.mean([a.num_forwards for a in mine]))
    assert group["tokens_per_s"] == pytest.approx(sum(a.num_tokens for a in mine) / batch.seconds)
    assert group["latency_s"] == pytest.approx(batch.seconds)
    assert group["seconds_per_forward"] == pytest.approx(batch.seconds / batch.forwards)


# ------------------------------------------------------------------ the command


def test_cli_builtin_split_matches_the_decoder_and_the_checker(capsys, tmp_path, hf_model):
  model, hf_dir = hf_model
  out_file = tmp_path / "refusion.json"
  code, out, err = run_cli(
    capsys,
    "--checkpoint",
    hf_dir,
    "--tokenizer",
    "bytes",
    "--config",
    SMOKE,
    "--num_examples",
    3,
    "--out",
    out_file,
    "--no_progress",
  )
  assert code == 0, err
  record = json.loads(out_file.read_text())
  examples = generate_examples("test", 8, seed=0, tasks=("sort", "lookup", "code"))[:3]
  assert [a["query"] for a in record["answers"]] == [e["query"] for e in examples]
  knobs = dict(gen_length=16, slot_size=4, serial_blocks=1, slot_threshold=0.9, token_threshold=0.5)
  assert {k: record["knobs"][k] for k in knobs} == knobs
  for answer, example in zip(record["answers"], examples):
    # each task is a batch of its own here: decode it alone and compare
    expected = rj.decode(model, [TOK.encode(example["query"])], rj.ReFusion(**knobs))
    assert answer["answer"] == TOK.decode(expected.tokens[0])
    assert answer["num_forwards"] == int(expected.num_forwards[0])
    assert answer["correct"] == check_answer(example["task"], example["query"], answer["answer"])
  metrics = record["metrics"]
  assert set(metrics["by_task"]) == {"sort", "lookup", "code"}
  assert metrics["tokens_per_s"] > 0 and metrics["compile_s"] > 0
  assert "accuracy" in out and "compilation" in out


def test_cli_json_test_set_exact_match_and_batches(capsys, tmp_path, hf_model):
  model, hf_dir = hf_model
  queries = ["ab c", "xyz", "hello", "q r"]
  prompts = [TOK.encode(q) for q in queries]
  expected = rj.decode(model, prompts, rj.AR(gen_length=16))
  answers = [TOK.decode(t) for t in expected.tokens]
  # the first two references are the model's own answers with extra whitespace: exact match after normalising
  records = [{"query": q, "response": "  " + a.replace(" ", "   ") + " "} for q, a in zip(queries[:2], answers)]
  records += [{"query": q, "response": a + "!"} for q, a in zip(queries[2:], answers[2:])]
  data = write_json(tmp_path / "test.json", records)
  out_file = tmp_path / "ar.json"
  code, _, err = run_cli(
    capsys, "--checkpoint", hf_dir, "--tokenizer", "bytes", "--config", SMOKE, "--data", data,
    "--method", "ar", "--batch_size", 4, "--out", out_file, "--no_progress", "--model_name", "tiny",
  )  # fmt: skip
  assert code == 0, err
  record = json.loads(out_file.read_text())
  by_query = {a["query"]: a for a in record["answers"]}
  for query, answer, normalisable in zip(queries, answers, (True, True, False, False)):
    assert by_query[query]["answer"] == answer
    assert by_query[query]["correct"] == normalisable
  assert record["metrics"]["accuracy"] == 0.5
  assert record["model"] == "tiny" and record["data"]["file"].endswith("test.json")


def test_cli_sweeps_every_combination_and_rejects_bad_input(capsys, tmp_path, hf_model):
  hf_dir = hf_model[1]
  data = write_json(tmp_path / "t.json", [{"query": "abc", "response": "d"}])
  sweep = tmp_path / "sweep"
  code, out, err = run_cli(
    capsys, "--checkpoint", hf_dir, "--tokenizer", "bytes", "--config", SMOKE, "--data", data,
    "--method", "mdm", "--steps", "4,2", "--block_length", "8,16", "--out_dir", sweep, "--no_progress",
  )  # fmt: skip
  assert code == 0, err
  records = [json.loads(path.read_text()) for path in sorted(sweep.iterdir())]
  settings = {(r["knobs"]["block_length"], r["knobs"]["steps"]) for r in records}
  assert settings == {(8, 4), (8, 2), (16, 4), (16, 2)}
  for r in records:
    assert r["metrics"]["mean_forwards"] == r["knobs"]["steps"]
    assert r["label"] == f"mdm B{r['knobs']['block_length']} {r['knobs']['steps']} steps"
  code, _, err = run_cli(
    capsys,
    "--checkpoint",
    hf_dir,
    "--tokenizer",
    "bytes",
    "--config",
    SMOKE,
    "--slot_size",
    "2,4",
    "--out",
    sweep / "x",
  )
  assert code == 2 and "--out_dir" in err
  code, _, err = run_cli(
    capsys, "--checkpoint", hf_dir, "--tokenizer", "bytes", "--config", SMOKE, "--slot_size", "4,x"
  )
  assert code == 2 and "comma-separated" in err
  code, _, err = run_cli(capsys, "--checkpoint", tmp_path / "missing", "--config", SMOKE)
  assert code == 2 and "does not exist" in err
  code, _, err = run_cli(
    capsys, "--checkpoint", hf_dir, "--tokenizer", "bytes", "--config", SMOKE, "--data", tmp_path / "no.json"
  )
  assert code == 2 and "--data" in err
  code, _, err = run_cli(capsys, "--checkpoint", hf_dir, "--tokenizer", "bytes", "--config", tmp_path / "nope.py")
  assert code == 2 and "--config" in err


def test_cli_applies_the_config_its_run_recorded_from_any_folder(capsys, tmp_path, hf_model, monkeypatch):
  model, hf_dir = hf_model
  run = tmp_path / "run"
  export.write_refusion(model, str(run), step=1, tokenizer="bytes")
  config = load_config(*SMOKE.split(":"))
  config.data.num_test = 3  # not the smoke file's 8: the recorded config, not a config file, sets the split
  write_run_config(config, str(run))
  monkeypatch.chdir(tmp_path)  # no configs/ folder here
  for checkpoint in (run, run / "checkpoints" / "1"):  # the workdir, or one step of it
    code, _, err = run_cli(capsys, "--checkpoint", checkpoint, "--out", "r.json", "--no_progress")
    assert code == 0, err
    assert len(json.loads((tmp_path / "r.json").read_text())["answers"]) == 3
  os.remove(run / RUN_CONFIG_FILE)  # a run trained before runs recorded their config, or a Hugging Face directory
  for source in (run, hf_dir):
    code, _, err = run_cli(capsys, "--checkpoint", source, "--tokenizer", "bytes")
    assert code == 2 and "records no training config" in err and "--config configs/demo.py" in err


# ------------------------------------------------------------------ the report


def test_pareto_front_against_brute_force():
  rng = np.random.default_rng(11)
  points = [tuple(p) for p in rng.integers(0, 6, size=(25, 2)).astype(float)]
  front = set(report.pareto_front(points))
  for i, (x, y) in enumerate(points):
    beaten = any(ox >= x and oy >= y and (ox, oy) != (x, y) for ox, oy in points)
    assert (i in front) == (not beaten)


def fake_record(model, label, accuracy, speed, split="test"):
  group = dict(count=4, accuracy=accuracy, mean_forwards=3.0, mean_tokens=6.0, tpf=2.0, tokens_per_s=speed)
  group.update(latency_s=0.1, seconds_per_answer=0.01)
  metrics = dict(group, compile_s=1.0, by_task={"sort": dict(group), "code": dict(group, accuracy=1.0)})
  return dict(model=model, label=label, method="refusion", checkpoint="/x", data=dict(split=split), metrics=metrics)


def test_report_writes_table_and_plot(capsys, tmp_path):
  results = tmp_path / "results"
  (results / "sub").mkdir(parents=True)
  rows = [("ar", "ar", 0.9, 100.0), ("refusion", "S8", 0.8, 300.0), ("refusion", "S4", 0.7, 200.0)]
  for i, row in enumerate(rows):
    (results / "sub" / f"{i}.json").write_text(json.dumps(fake_record(*row)))
  (results / "other.json").write_text(json.dumps({"not": "a result"}))
  code, out, err = run_cli(capsys, "report", results, "--title", "# Results")
  assert code == 0, err
  table = (results / "table.md").read_text()
  assert table.startswith("# Results")
  assert "| ar | ar ★ |" in table and "| refusion | S8 ★ |" in table and "| refusion | S4 |" in table
  assert "90.0 / 2.00 / 100" in table and "100.0 / 2.00 / 300" in table
  assert (results / "speed_accuracy.png").read_bytes()[:4] == b"\x89PNG"
  code, _, err = run_cli(capsys, "report", tmp_path / "empty_missing")
  assert code == 2 and "result files" in err


def test_curve_reads_the_trainers_event_files(capsys, tmp_path):
  from tensorboardX import SummaryWriter

  rng = np.random.default_rng(2)
  values = {step: rng.uniform(size=3) for step in (250, 500, 750)}
  writer = SummaryWriter(logdir=str(tmp_path / "tensorboard"))
  for step, (lookup, sort, tpf) in values.items():
    writer.add_scalar("eval/exact_match_lookup", lookup, step)
    writer.add_scalar("eval/exact_match_sort", sort, step)
    writer.add_scalar("eval/exact_match", (lookup + sort) / 2, step)
    writer.add_scalar("eval/tpf", 4 * tpf, step)
    writer.add_scalar("train/loss", 1.0, step)
  writer.close()
  code, out, err = run_cli(capsys, "curve", tmp_path, "--out_dir", tmp_path / "out")
  assert code == 0, err
  rows = (tmp_path / "out" / "learning_curve.md").read_text().splitlines()
  assert rows[0] == "| step | lookup | sort | all | TPF |"
  for row, (step, (lookup, sort, tpf)) in zip(rows[2:], values.items()):
    expected = [step, 100 * lookup, 100 * sort, 50 * (lookup + sort), 4 * tpf]
    assert [float(cell) for cell in row.strip("| ").split(" | ")] == pytest.approx(expected, abs=0.06)
  assert (tmp_path / "out" / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"
  code, _, err = run_cli(capsys, "curve", tmp_path / "nothing")
  assert code == 2 and "event files" in err


@pytest.mark.parametrize("name", ["demo", "ar_baseline", "mdm_baseline"])
def test_config_eval_settings_decode_with_every_method(name):
  from helpers.train_utils import load_config

  from refusion_jax.decoding.checks import check_slot_layout
  from refusion_jax.decoding.mdm import check_mdm_schedule

  for variant in ("", "smoke"):
    ev = load_config(name, variant).eval
    check_slot_layout(ev.gen_length, ev.slot_size, ev.serial_blocks)
    check_mdm_schedule(ev.gen_length, ev.mdm_block_length, ev.mdm_steps)  # once raised for the demo: 64 vs G = 48
