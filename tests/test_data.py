"""Built-in tasks, tfds array_record builders and the grain batch pipeline."""

import json
import os
import random
import threading

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow_datasets as tfds

from refusion_jax.data import builders, composite, pipeline, tasks
from refusion_jax.data.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()


def _random_text(rng, max_len):
  alphabet = "abcxyz 0123456789+=;:é漢🙂"
  return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, max_len)))


def _random_records(rng, n):
  return [{"query": f"{i}:{_random_text(rng, 20)}", "response": _random_text(rng, 20)} for i in range(n)]


# Built-in tasks -------------------------------------------------------------


def test_generation_is_deterministic_given_seed():
  first = tasks.generate_examples("train", 210, seed=5)
  assert first == tasks.generate_examples("train", 210, seed=5)
  assert first != tasks.generate_examples("train", 210, seed=6)
  assert {e["task"] for e in first} == set(tasks.TASKS)


def test_splits_are_disjoint():
  queries = {split: [e["query"] for e in tasks.generate_examples(split, 350, seed=2)] for split in tasks.SPLITS}
  for split, split_queries in queries.items():
    assert len(set(split_queries)) == len(split_queries)
    assert all(tasks.split_of(q) == split for q in split_queries)
  assert not set(queries["train"]) & set(queries["validation"])
  assert not set(queries["train"]) & set(queries["test"])
  assert not set(queries["validation"]) & set(queries["test"])


def test_examples_fit_the_byte_sequence_length():
  for example in tasks.generate_examples("train", 1400, seed=3):
    total = len(TOKENIZER.encode(example["query"])) + len(TOKENIZER.encode(example["response"])) + 1
    assert total <= tasks.BYTE_SEQ_LEN, example


def test_checker_accepts_generated_responses_up_to_whitespace():
  rng = random.Random(0)
  for example in tasks.generate_examples("test", 140, seed=4):
    response = example["response"]
    assert tasks.check_answer(example["task"], example["query"], response)
    spaced = "  " + response.replace(" ", rng.choice(["  ", "\t", " \n "])) + "\n"
    assert tasks.check_answer(example["task"], example["query"], spaced)


def _corrupt(rng, task, response):
  """Changes one non-space character of the graded part of `response`."""
  start = response.rindex(" so ") + 4 if task == "add_steps" else 0
  position = rng.choice([i for i in range(start, len(response)) if not response[i].isspace()])
  replacement = rng.choice([c for c in "0123456789abcxyz()+*" if c != response[position]])
  return response[:position] + replacement + response[position + 1 :]


def test_checker_rejects_corrupted_responses():
  rng = random.Random(1)
  for example in tasks.generate_examples("validation", 140, seed=4):
    task, query, response = example["task"], example["query"], example["response"]
    assert not tasks.check_answer(task, query, _corrupt(rng, task, response))
    assert not tasks.check_answer(task, query, response + " 1")
    assert not tasks.check_answer(task, query, "")


def test_add_steps_shows_carries_and_grades_the_sum():
  assert tasks.solve("add_steps", "add steps: 958+67") == "8+7=15 5+6+1=12 9+0+1=10 so 1025"
  assert tasks.check_answer("add_steps", "add steps: 958+67", "wrong working so 1025")
  assert tasks.solve("code", "code n: sub 3; mul 4") == "def sub3_mul4(n): return (n - 3) * 4"
  assert tasks.solve("code", "code x: mul 3; add 4") == "def mul3_add4(x): return x * 3 + 4"


def test_foreign_queries_and_unknown_tasks_are_errors():
  with pytest.raises(ValueError, match="is not a 'sort' query"):
    tasks.check_answer("sort", "add: 1+2", "3")
  with pytest.raises(ValueError, match="Unknown task"):
    tasks.solve("multiply", "2*3")
  with pytest.raises(ValueError, match="Unknown split"):
    tasks.generate_examples("dev", 3)


def test_composite_records_show_solved_examples_then_ask_one_of_their_split():
  records = composite.composite_examples("validation", 60, seed=3, task_names=("sort", "lookup"), max_context=3)
  assert records == composite.composite_examples("validation", 60, seed=3, task_names=("sort", "lookup"), max_context=3)
  train_queries = {
    part.split(" -> ")[0]
    for record in composite.composite_examples("train", 60, seed=3, max_context=3)
    for part in record["query"].split(" | ")
  }
  counts = set()
  for record in records:
    *context, query = record["query"].split(" | ")
    counts.add(len(context))
    solved = [part.split(" -> ") for part in context]
    queries = [q for q, _ in solved] + [query]
    assert len(set(queries)) == len(queries) and not set(queries) & train_queries
    for part_query, part_response in [*solved, (query, record["response"])]:
      task = "sort" if part_query.startswith("sort") else "lookup"
      assert tasks.check_answer(task, part_query, part_response)
  assert counts == {0, 1, 2, 3}


# Builders -------------------------------------------------------------------


def test_query_response_json_round_trips_through_array_record(tmp_path):
  rng = random.Random(7)
  train_a, train_b, test = _random_records(rng, 23), _random_records(rng, 17), _random_records(rng, 9)
  for record in train_b:
    record["task"] = "chat"
  (tmp_path / "a.json").write_text(json.dumps(train_a, ensure_ascii=False), encoding="utf-8")
  (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in train_b) + "\n", encoding="utf-8")
  (tmp_path / "t.json").write_text(json.dumps(test), encoding="utf-8")
  data_dir = str(tmp_path / "data")
  built = builders.build_query_response_json(
    data_dir, {"train": [str(tmp_path / "a.json"), str(tmp_path / "b.jsonl")], "test": str(tmp_path / "t.json")}
  )
  assert {split: len(source) for split, source in built.items()} == {"train": 40, "test": 9}

  (config_name,) = os.listdir(os.path.join(data_dir, "query_response_json"))
  sources = tfds.data_source(f"query_response_json/{config_name}", data_dir=data_dir, download=False)

  def texts(source):
    return sorted(tuple(sorted(pipeline.decode_record(record).items())) for record in source)

  def expected(records):
    return sorted(tuple(sorted({"task": "", **record}.items())) for record in records)

  assert texts(sources["train"]) == expected(train_a + train_b)
  assert texts(sources["test"]) == expected(test)


def test_the_official_release_format_is_read_and_packed(tmp_path):
  """tests/fixtures/official_format/train_data.json has the layout of ML-GSAI/ReFusion's data/train_data.json."""
  path = os.path.join(os.path.dirname(__file__), "fixtures", "official_format", "train_data.json")
  with open(path, encoding="utf-8") as f:
    records = json.load(f)
  built = builders.build_query_response_json(str(tmp_path / "data"), {"train": [path]})
  stored = [pipeline.decode_record(record) for record in built["train"]]
  assert sorted((r["query"], r["response"]) for r in stored) == sorted((r["query"], r["response"]) for r in records)
  assert any("\n" in r["response"] for r in stored) and any("é" in r["query"] for r in stored)  # escapes decoded
  batch = next(iter(pipeline.make_dataset(built["train"], TOKENIZER, seq_len=256, batch_size=2, seed=0, packing=True)))
  assert int((batch["answer_len"] > 0).sum()) >= 3  # every record, packed into at most two rows


def test_a_json_file_of_json_lines_is_read_as_json_lines(tmp_path):
  records = _random_records(random.Random(8), 5)
  (tmp_path / "lines.json").write_text("\n".join(json.dumps(r) for r in records), encoding="utf-8")
  built = builders.build_query_response_json(str(tmp_path / "data"), {"train": [str(tmp_path / "lines.json")]})
  assert sorted(pipeline.decode_record(r)["query"] for r in built["train"]) == sorted(r["query"] for r in records)


def test_query_response_json_errors_name_the_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="missing.json"):
    builders.build_query_response_json(str(tmp_path / "data"), {"train": [str(tmp_path / "missing.json")]})
  (tmp_path / "bad.json").write_text(json.dumps([{"query": "q", "response": "r"}, {"prompt": "q"}]))
  with pytest.raises(ValueError, match="bad.json, record 1"):
    builders.build_query_response_json(str(tmp_path / "data"), {"train": [str(tmp_path / "bad.json")]})


def test_refusion_tasks_builder_stores_the_generated_splits(tmp_path):
  sizes = {"train": 150, "validation": 40, "test": 30}
  sources = builders.build_refusion_tasks(
    str(tmp_path), num_train=150, num_validation=40, num_test=30, seed=9, task_names=("sort", "lookup")
  )
  for split, size in sizes.items():
    stored = sorted(tuple(sorted(pipeline.decode_record(r).items())) for r in sources[split])
    generated = tasks.generate_examples(split, size, seed=9, tasks=("sort", "lookup"))
    assert stored == sorted(tuple(sorted(e.items())) for e in generated)
  resized = builders.build_refusion_tasks(
    str(tmp_path), num_train=160, num_validation=40, num_test=30, seed=9, task_names=("sort", "lookup")
  )
  assert len(resized["train"]) == 160  # a new config, not the stale 150-example build


# Pipeline -------------------------------------------------------------------


def _queries(batches):
  prompts = [p for batch in batches for p in pipeline.batch_prompts_and_answers(batch)[0]]
  return [TOKENIZER.decode(p) for p in prompts]


def test_batches_follow_the_contract():
  source = tasks.generate_examples("train", 37, seed=11)
  dataset = pipeline.make_dataset(source, TOKENIZER, seq_len=64, batch_size=8, seed=0, shuffle=False, num_epochs=1)
  batches = list(dataset)
  assert len(batches) == 5
  for batch in batches:
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
      "tokens": ((8, 64), np.int32),
      "prompt_len": ((8,), np.int32),
      "answer_len": ((8,), np.int32),
    }
  rows = [(b["tokens"][i], b["prompt_len"][i], b["answer_len"][i]) for b in batches for i in range(8)]
  for record, (tokens, prompt_len, answer_len) in zip(source, rows):
    expected = TOKENIZER.encode(record["query"]) + TOKENIZER.encode(record["response"]) + [TOKENIZER.eos_id]
    assert prompt_len == len(TOKENIZER.encode(record["query"]))
    assert answer_len == len(expected) - prompt_len
    np.testing.assert_array_equal(tokens, expected + [TOKENIZER.pad_id] * (64 - len(expected)))
  for tokens, prompt_len, answer_len in rows[37:]:  # the filled tail of the last batch
    assert prompt_len == answer_len == 0 and (tokens == TOKENIZER.pad_id).all()
  prompts, answers = pipeline.batch_prompts_and_answers(batches[-1])
  assert len(prompts) == 37 - 32
  assert [TOKENIZER.decode(a) for a in answers] == [r["response"] for r in source[32:]]
  assert answers[0][-1] == TOKENIZER.eos_id


def test_drop_remainder_drops_the_partial_batch():
  source = tasks.generate_examples("train", 37, seed=11)
  dataset = pipeline.make_dataset(
    source, TOKENIZER, seq_len=64, batch_size=8, seed=0, num_epochs=1, drop_remainder=True
  )
  assert len(list(dataset)) == 4


def test_too_long_examples_are_dropped_and_logged(caplog):
  rng = random.Random(12)
  source = [{"query": _random_text(rng, 12), "response": _random_text(rng, 12)} for _ in range(60)]
  seq_len = 24
  fits = [r for r in source if len(TOKENIZER.encode(r["query"] + r["response"])) + 1 <= seq_len]
  assert 0 < len(fits) < len(source)
  with caplog.at_level("WARNING"):
    batches = list(
      pipeline.make_dataset(source, TOKENIZER, seq_len=seq_len, batch_size=4, seed=0, shuffle=False, num_epochs=1)
    )
  assert _queries(batches) == [r["query"] for r in fits]
  assert "Dropped 1 example(s) longer than seq_len=24" in caplog.text


def test_chat_template_wraps_queries():
  class Bracketed(ByteTokenizer):
    def apply_chat_template(self, query):
      return f"<{query}>"

  source = tasks.generate_examples("train", 5, seed=13)
  batch = next(
    iter(
      pipeline.make_dataset(source, Bracketed(), seq_len=64, batch_size=5, seed=0, shuffle=False, chat_template=True)
    )
  )
  assert _queries([batch]) == [f"<{r['query']}>" for r in source]


def test_shuffle_is_seeded_and_reshuffles_each_epoch():
  source = tasks.generate_examples("train", 40, seed=14)

  def order(seed):
    dataset = pipeline.make_dataset(source, TOKENIZER, seq_len=64, batch_size=10, seed=seed, num_epochs=2)
    return _queries(dataset)

  first = order(0)
  assert first == order(0)
  assert first != order(1)
  queries = [r["query"] for r in source]
  assert sorted(first[:40]) == sorted(first[40:]) == sorted(queries)
  assert first[:40] != queries and first[:40] != first[40:]


def test_shards_are_disjoint_and_cover_the_data():
  source = tasks.generate_examples("train", 45, seed=15)
  shards = [
    _queries(
      pipeline.make_dataset(
        source, TOKENIZER, seq_len=64, batch_size=4, seed=3, num_epochs=1, shard_index=i, shard_count=2
      )
    )
    for i in range(2)
  ]
  assert not set(shards[0]) & set(shards[1])
  assert sorted(shards[0] + shards[1]) == sorted(r["query"] for r in source)
  with pytest.raises(ValueError, match="shard_index=2"):
    pipeline.make_dataset(source, TOKENIZER, seq_len=64, batch_size=4, seed=3, shard_index=2, shard_count=2)


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _assert_same_batches(actual, expected):
  assert len(actual) == len(expected)
  for a, e in zip(actual, expected):
    for key in e:
      np.testing.assert_array_equal(a[key], e[key])


def test_iterator_state_round_trip_resumes_exactly():
  source = tasks.generate_examples("train", 30, seed=16)
  dataset = pipeline.make_dataset(source, TOKENIZER, seq_len=64, batch_size=4, seed=8)
  iterator = iter(dataset)
  _take(iterator, 5)
  state = json.loads(json.dumps(iterator.get_state()))
  expected = _take(iterator, 9)  # crosses into the second epoch (30 records / 4 per batch)
  resumed = iter(dataset)
  resumed.set_state(state)
  _assert_same_batches(_take(resumed, 9), expected)


def test_iterator_state_round_trips_through_an_orbax_checkpoint(tmp_path):
  source = tasks.generate_examples("train", 30, seed=17)
  dataset = pipeline.make_dataset(source, TOKENIZER, seq_len=64, batch_size=4, seed=9)
  iterator = iter(dataset)
  _take(iterator, 3)
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    manager.save(2, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(iterator)))
    manager.wait_until_finished()
  expected = _take(iterator, 6)
  resumed = iter(dataset)
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    manager.restore(2, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(resumed)))
  _assert_same_batches(_take(resumed, 6), expected)


# Packed rows -----------------------------------------------------------------


def _packed(source, **kwargs):
  options = dict(seq_len=64, batch_size=4, seed=0, packing=True, max_segments=3, packing_bins=8)
  return pipeline.make_dataset(source, TOKENIZER, **{**options, **kwargs})


def test_packed_batches_hold_every_example_once_back_to_back():
  source = tasks.generate_examples("train", 61, seed=21)
  batches = list(_packed(source, shuffle=False, num_epochs=1))
  for batch in batches:
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
      "tokens": ((4, 64), np.int32),
      "prompt_len": ((4, 3), np.int32),
      "answer_len": ((4, 3), np.int32),
    }
    used = (batch["prompt_len"] + batch["answer_len"]).sum(1)
    assert (used <= 64).all()
    for row, end in zip(batch["tokens"], used):
      assert (row[end:] == TOKENIZER.pad_id).all()
  prompts, answers = zip(*(pair for batch in batches for pair in zip(*pipeline.batch_prompts_and_answers(batch))))
  expected = sorted(
    (TOKENIZER.encode(r["query"]), TOKENIZER.encode(r["response"]) + [TOKENIZER.eos_id]) for r in source
  )
  assert sorted(zip(prompts, answers)) == expected
  rows = sum(len(b["tokens"]) for b in batches)
  assert rows < 61 / 1.5  # examples of 21-63 tokens: most rows hold two or more
  assert max(int((b["answer_len"] > 0).sum(1).max()) for b in batches) == 3


def test_packing_leaves_less_padding():
  source = tasks.generate_examples("train", 200, seed=22)
  unpacked = pipeline.make_dataset(source, TOKENIZER, seq_len=64, batch_size=4, seed=0, num_epochs=1)
  packed = _packed(source, num_epochs=1, max_segments=4, packing_bins=32, drop_remainder=True)
  unpacked_pad = np.mean([pipeline.pad_fraction(b) for b in unpacked])
  packed_pad = np.mean([pipeline.pad_fraction(b) for b in packed])
  assert packed_pad < 0.2 < 0.3 < unpacked_pad


def test_pad_fraction_counts_positions_outside_every_example():
  batch = {
    "tokens": np.zeros((2, 10), np.int32),
    "prompt_len": np.asarray([[2, 1], [3, 0]]),
    "answer_len": np.asarray([[4, 2], [1, 0]]),
  }
  assert pipeline.pad_fraction(batch) == pytest.approx(1 - 13 / 20)


def test_packed_iterator_state_resumes_exactly_mid_pack():
  source = tasks.generate_examples("train", 40, seed=23)
  dataset = _packed(source, seed=5)
  iterator = iter(dataset)
  _take(iterator, 3)  # 12 rows: inside the second set of 8 packed bins
  state = json.loads(json.dumps(iterator.get_state()))
  expected = _take(iterator, 12)  # crosses into later epochs (40 examples fill about 20 rows)
  resumed = iter(dataset)
  resumed.set_state(state)
  _assert_same_batches(_take(resumed, 12), expected)


def test_exhausted_task_reports_its_own_example_count(monkeypatch):
  # A task with three train queries, interleaved with a task that never runs out.
  queries = [q for q in (f"tiny {i}" for i in range(100)) if tasks.split_of(q) == "train"][:3]
  tiny = tasks._Task(make_query=lambda rng: rng.choice(queries), solve=lambda query: query)
  monkeypatch.setitem(tasks._TASKS, "tiny", tiny)
  monkeypatch.setattr(tasks, "_MAX_DRAWS_PER_EXAMPLE", 50)
  with pytest.raises(ValueError, match=r"'tiny' ran out of distinct train queries after 3 of its examples \(7 over"):
    tasks.generate_examples("train", 20, seed=4, tasks=("copy", "tiny"))


# Unusable data ---------------------------------------------------------------


def _first_batch_or_error(dataset, timeout_s: float = 120.0):
  """next(iter(dataset)) on a thread: an endless wait fails the test instead of hanging it."""
  outcome = {}

  def fetch():
    try:
      outcome["batch"] = next(iter(dataset))
    except Exception as error:  # handed to the test
      outcome["error"] = error

  thread = threading.Thread(target=fetch, daemon=True)
  thread.start()
  thread.join(timeout_s)
  assert outcome, f"no batch and no error after {timeout_s} s: the pipeline hangs"
  return outcome


def _long_records(rng, count, min_len):
  return [{"query": "q" * rng.randint(min_len, 2 * min_len), "response": _random_text(rng, 10)} for _ in range(count)]


@pytest.mark.parametrize("shard_count", [1, 2])
def test_endless_pass_that_keeps_nothing_is_an_error_with_the_numbers(shard_count):
  rng = random.Random(21)
  source = _long_records(rng, 30, 40)
  shard = source[0::shard_count]
  lengths = [len(TOKENIZER.encode(r["query"] + r["response"])) + 1 for r in shard]
  dataset = pipeline.make_dataset(
    source, TOKENIZER, seq_len=32, batch_size=4, seed=0, shard_index=0, shard_count=shard_count, name="data.json"
  )
  error = _first_batch_or_error(dataset).get("error")
  assert isinstance(error, pipeline.DataError), error
  message = str(error)
  assert f"{len(shard)} of the {len(shard)} examples of data.json are longer than seq_len=32" in message
  assert f"the shortest dropped has {min(lengths)}, the longest example {max(lengths)}" in message
  assert f"raise seq_len to at least {min(lengths)}" in message


def test_eval_pass_that_keeps_nothing_is_an_error_too():
  source = _long_records(random.Random(22), 9, 40)
  dataset = pipeline.make_dataset(source, TOKENIZER, seq_len=16, batch_size=4, seed=0, num_epochs=1, name="val.json")
  with pytest.raises(pipeline.DataError, match="9 of the 9 examples of val.json"):
    list(dataset)


def test_many_drops_warn_once_with_the_numbers(caplog):
  rng = random.Random(23)
  source = [{"query": _random_text(rng, 6), "response": _random_text(rng, 6)} for _ in range(20)]
  source += _long_records(rng, 10, 40)
  dataset = pipeline.make_dataset(source, TOKENIZER, seq_len=32, batch_size=4, seed=0, name="mix.json")
  with caplog.at_level("WARNING"):
    iterator = iter(dataset)
    for _ in range(20):  # several passes
      next(iterator)
  summaries = [r.message for r in caplog.records if "examples of mix.json" in r.message]
  assert len(summaries) == 1 and "10 of the 30 examples of mix.json are longer than seq_len=32" in summaries[0]
  caplog.clear()
  with caplog.at_level("WARNING"):
    list(
      pipeline.make_dataset(source, TOKENIZER, seq_len=32, batch_size=4, seed=0, num_epochs=1, warn_drop_fraction=0.5)
    )
  assert "examples of the data" not in caplog.text  # 1/3 dropped: under the fraction


@pytest.mark.parametrize("record", [{"query": "q"}, {"query": "q", "response": 7}, {"prompt": "q", "response": "r"}])
def test_record_without_string_fields_is_named(record):
  source = [{"query": "a", "response": "b"}] * 3 + [record]
  dataset = pipeline.make_dataset(source, TOKENIZER, seq_len=32, batch_size=4, seed=0, num_epochs=1, name="mine")
  with pytest.raises(pipeline.DataError, match="Record 3 of mine has no string"):
    list(dataset)


def test_empty_source_is_named():
  with pytest.raises(pipeline.DataError, match="mine has no records"):
    pipeline.make_dataset([], TOKENIZER, seq_len=32, batch_size=4, seed=0, name="mine")


@pytest.mark.parametrize(
  "name, content, message",
  [
    ("empty.json", b"", "empty.json is empty"),
    ("blank.json", b"  \n", "blank.json is empty"),
    ("none.json", b"[]", "none.json holds no records"),
    (
      "latin1.json",
      '[{"query": "caf\u00e9", "response": "r"}]'.encode("latin-1"),
      r"latin1.json is not UTF-8 text \(byte 15",
    ),
    ("lines.jsonl", b'{"query": "q", "response": "r"}\n{"query": \n', "lines.jsonl, line 2: not valid JSON"),
    ("type.json", b'[{"query": "q", "response": ["r"]}]', "type.json, record 0: 'response' is a JSON list"),
    ("missing.json", b'[{"query": "q", "response": "r"}, {"query": "q"}]', "missing.json, record 1: no 'response'"),
    ("scalar.json", b'[{"query": "q", "response": "r"}, 3]', "scalar.json, record 1: a JSON int"),
  ],
)
def test_bad_json_files_are_our_errors_naming_file_and_record(tmp_path, name, content, message):
  (tmp_path / name).write_bytes(content)
  with pytest.raises(pipeline.DataError, match=message):
    builders.build_query_response_json(str(tmp_path / "data"), {"train": [str(tmp_path / name)]})
