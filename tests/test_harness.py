"""The lm-evaluation-harness model (`refusion_jax.evaluation.harness`) and its command line, offline.

A task YAML over a JSONL file (tests/fixtures/harness) runs through the
command line and through `simple_evaluate` on a tiny random model, with the
byte tokenizer and with a byte-level BPE tokenizer whose chat template the test
writes. Every decode uses G = 16, S = 4 and 4 rows, so the modules' compiled
programs are shared. The comparison with the official `Qwen3EvalHarness` is
slow-marked and needs REFUSION_OFFICIAL_REPO (see its docstring).
"""

import dataclasses
import glob
import json
import os
import pathlib
import sys
import types

import numpy as np
import pytest
from helpers.extras import module_needs

pytestmark = module_needs("eval")

import refusion_jax as rj  # noqa: E402
from refusion_jax import harness as cli  # noqa: E402
from refusion_jax.data.tokenizer import HFTokenizer  # noqa: E402
from refusion_jax.decoding.refusion import fitted_serial_blocks  # noqa: E402
from refusion_jax.decoding.result import PHASE_INFILL, PHASE_NONE, PHASE_VERIFY, DecodeResult  # noqa: E402
from refusion_jax.evaluation import harness  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "harness"
KNOBS = dict(gen_length=16, slot_size=4, batch_size=4)
QWEN_LIKE_TEMPLATE = (
  "{%- for message in messages -%}"
  "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
  "{%- endfor -%}"
  "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
  "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
  "{%- endif -%}"
)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.chdir(ROOT)  # the task YAML names its data file from the repository root


def save_bpe_tokenizer(directory: pathlib.Path, seed: int) -> HFTokenizer:
  """A byte-level BPE tokenizer (Qwen's kind) trained on random task-like text, with a ChatML chat template."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  rng = np.random.default_rng(seed)
  words = ["sort", "find", "code", "add", "sub", "Answer", "def", "return", "```python"]
  corpus = [" ".join(rng.choice(words, 6)) + f" {rng.integers(1000)}=" + "abcxyz"[rng.integers(6)] for _ in range(200)]
  raw = Tokenizer(models.BPE())
  raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  raw.decoder = decoders.ByteLevel()
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  raw.train_from_iterator(
    corpus, trainers.BpeTrainer(vocab_size=320, special_tokens=specials, initial_alphabet=alphabet)
  )
  directory.mkdir(parents=True, exist_ok=True)
  raw.save(str(directory / "tokenizer.json"))
  config = dict(
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    chat_template=QWEN_LIKE_TEMPLATE,
    tokenizer_class="PreTrainedTokenizerFast",
  )
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  return HFTokenizer(str(directory))


@pytest.fixture(scope="module")
def byte_model():
  return rj.load("tiny")  # the random preset the command line loads for checkpoint=tiny


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  directory = tmp_path_factory.mktemp("bpe")
  tokenizer = save_bpe_tokenizer(directory, seed=int(np.random.default_rng().integers(1 << 16)))
  model, _ = rj.load("tiny", tokenizer=str(directory))
  return model, tokenizer, directory


def read_jsonl(path) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def reference_texts(model, tokenizer, prompts: list[str], until: list[str]) -> list[str]:
  """What `rj.Sampler` answers (one queue: every prompt padded to the longest's bucket), post-processed as the
  official harness does: spelled with its special tokens, cut at the stop strings, spelled again without them."""
  _, result = rj.Sampler(model, tokenizer, rj.ReFusion(gen_length=16, slot_size=4), rows=4).generate(prompts)
  # Not the Sampler's text: a special token drawn inside a multi-byte character leaves it cut when spelled out.
  spelled = dict(skip_special_tokens=False) if isinstance(tokenizer, HFTokenizer) else {}  # bytes: none to spell
  texts = [tokenizer.decode(tokens, **spelled) for tokens in result.tokens]
  for stop in until:
    texts = [t.split(stop)[0] for t in texts]
  return [tokenizer.decode(tokenizer.encode(t)) for t in texts]


# --- the command line -----------------------------------------------------------------------------------------


def test_command_line_writes_results_samples_and_stats_with_the_samplers_texts(tmp_path, byte_model):
  model, tokenizer = byte_model
  args = ",".join(["checkpoint=tiny", *(f"{k}={v}" for k, v in KNOBS.items())])
  argv = ["--model_args", args, "--include_path", str(FIXTURES), "--tasks", "refusion_tasks"]
  argv += ["--limit", "6", "--output_path", str(tmp_path), "--log_samples", "--seed", "0"]
  assert cli.main(argv) == 0
  (results_file,) = glob.glob(str(tmp_path / "*" / "results_*.json"))
  results = json.loads(pathlib.Path(results_file).read_text())["results"]["refusion_tasks"]
  assert "exact_match,strip" in results
  (samples_file,) = glob.glob(str(tmp_path / "*" / "samples_refusion_tasks_*.jsonl"))
  samples = sorted(read_jsonl(samples_file), key=lambda s: s["doc_id"])
  assert len(samples) == 6  # --limit
  queries = [s["doc"]["query"] for s in samples]
  # The first six prompts fall in two length buckets (16 and 32 bytes), decoded as two queues.
  assert {len(q) <= 16 for q in queries} == {True, False}
  assert [s["resps"][0][0] for s in samples] == reference_texts(model, tokenizer, queries, ["\n"])

  stats = json.loads((tmp_path / "refusion_stats" / "refusion_tasks" / "final_stats.json").read_text())
  official = ["processed_samples", "total_samples", "total_tokens", "total_time", "total_TPF", "tokens_per_second"]
  ours = ["tokens_per_forward", "forwards", "decode_seconds", "latency_per_sample", "compile_seconds"]
  assert set(official + ["latency", "TPF"] + ours) <= set(stats)
  assert stats["processed_samples"] == 6 and stats["rows"] == 4
  assert sorted(g["prompt_bucket"] for g in stats["groups"]) == [16, 32]
  per_sample = read_jsonl(tmp_path / "refusion_stats" / "refusion_tasks" / "sample_stats.jsonl")
  assert sorted(s["doc_id"] for s in per_sample) == list(range(6))
  assert sum(s["tokens"] for s in per_sample) == stats["total_tokens"]
  assert sum(s["forwards"] for s in per_sample) == stats["forwards"]
  assert stats["tokens_per_forward"] == pytest.approx(stats["total_tokens"] / stats["forwards"])
  assert stats["TPF"] == pytest.approx(np.mean([s["TPF"] for s in per_sample]))


@pytest.mark.parametrize(
  "model_args, message",
  [
    ("checkpoint=tiny,slot_szie=4", "Unknown --model_args key(s) slot_szie"),
    ("checkpoint=tiny,paper_task=gsm8k", "paper_task='gsm8k' is not one of the paper's tasks"),
    ("checkpoint=/no/such/checkpoint", "checkpoint='/no/such/checkpoint' does not exist"),
    ("checkpoint=tiny,method=beam", "method='beam': choose one of refusion, ar, mdm"),
    ("checkpoint=tiny,mesh=data:3", "mesh='data:3': The mesh"),
    ("checkpoint=tiny,mesh=rows:2", "mesh 'rows:2' names no mesh axis"),
  ],
)
def test_bad_model_args_exit_2_saying_what_is_wrong(capsys, model_args, message):
  assert cli.main(["--model_args", model_args, "--tasks", "refusion_tasks"]) == 2
  assert message in capsys.readouterr().err


def test_process_0_alone_writes_and_stats_go_beside_the_results():
  argv = ["--model_args", "checkpoint=c", "--tasks", "t", "--output_path", "out", "--log_samples"]
  first = cli.lm_eval_argv(argv, process_index=0)
  assert first[:2] == ["--model", "refusion_jax"]
  assert "checkpoint=c,stats_dir=out/refusion_stats,sample_stats=true" in first
  other = cli.lm_eval_argv(argv, process_index=3)
  assert "--output_path" not in other and "--log_samples" not in other and "out" not in other
  assert "checkpoint=c" in other


_ON_FOUR_DEVICES = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax
jax.config.update("jax_default_matmul_precision", "highest")
from lm_eval.api.instance import Instance
import refusion_jax as rj
from refusion_jax.evaluation.harness import ReFusionLM

queries, path = json.loads(sys.argv[1]), sys.argv[2]
rj.save_hf(rj.load("tiny")[0], path)  # a checkpoint, which is loaded straight into its shardings on the mesh
# Several devices: a data-parallel mesh by default.
lm = ReFusionLM(path, tokenizer="bytes", gen_length=16, slot_size=4, batch_size=4)
requests = [
  Instance("generate_until", {}, (q, {"until": ["\\n"]}), 0, metadata=("t", i, 1)) for i, q in enumerate(queries)
]
texts = lm.generate_until(requests)
embedding = jax.tree.leaves(__import__("flax").nnx.state(lm.model))[0]
print(json.dumps(dict(texts=texts, mesh=dict(lm.mesh.shape), sharded=embedding.sharding.mesh.shape == lm.mesh.shape)))
"""


def test_on_several_devices_the_model_takes_the_global_mesh_and_gives_the_same_texts(tmp_path, byte_model):
  from helpers.fake_devices import run_json

  model, tokenizer = byte_model
  # One prompt bucket, so one compiled program on the mesh.
  queries = [d["query"] for d in read_jsonl(FIXTURES / "refusion_tasks.jsonl") if len(d["query"]) <= 16][:5]
  out = run_json(_ON_FOUR_DEVICES, json.dumps(queries), str(tmp_path / "hf"))
  assert out["mesh"]["data"] == 4 and out["sharded"]
  assert out["texts"] == reference_texts(model, tokenizer, queries, ["\n"])


# --- from Python: simple_evaluate, an HF tokenizer and its chat template --------------------------------------


def test_simple_evaluate_continues_the_assistant_turn_of_a_gen_prefix_task(bpe):
  """With --apply_chat_template and a gen_prefix the prompt ends inside the assistant turn, as transformers
  renders it with continue_final_message (the official harness's call), and the answers are the Sampler's."""
  from lm_eval import simple_evaluate
  from lm_eval.tasks import TaskManager

  model, tokenizer, directory = bpe
  lm = harness.ReFusionLM(model=model, tokenizer=tokenizer, **KNOBS)
  out = simple_evaluate(
    model=lm,
    tasks=["refusion_tasks_prefix"],
    task_manager=TaskManager(include_path=str(FIXTURES), include_defaults=False),
    apply_chat_template=True,
    limit=4,
    log_samples=True,
  )
  samples = sorted(out["samples"]["refusion_tasks_prefix"], key=lambda s: s["doc_id"])
  prompts = [s["arguments"][0][0] for s in samples]
  transformers = pytest.importorskip("transformers")
  hf = transformers.AutoTokenizer.from_pretrained(str(directory))
  for sample, prompt in zip(samples, prompts):
    chat = [{"role": "user", "content": sample["doc"]["query"]}, {"role": "assistant", "content": "Answer:"}]
    expected = hf.apply_chat_template(chat, tokenize=False, continue_final_message=True, enable_thinking=True)
    assert prompt == expected and prompt.endswith("<|im_start|>assistant\nAnswer:")
  assert [s["resps"][0][0] for s in samples] == reference_texts(model, tokenizer, prompts, ["\n"])


def test_chat_template_renders_a_generation_prompt_with_thinking_on(bpe):
  transformers = pytest.importorskip("transformers")
  model, tokenizer, directory = bpe
  lm = harness.ReFusionLM(model=model, tokenizer=tokenizer, **KNOBS)
  chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "sort: c a b"}]
  hf = transformers.AutoTokenizer.from_pretrained(str(directory))
  expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=True)
  assert lm.apply_chat_template(chat) == expected
  assert "<think>" not in expected  # thinking on: no empty think block


# --- settings, post-processing and statistics ------------------------------------------------------------------


def test_paper_task_sets_the_papers_knobs_and_explicit_ones_override(byte_model):
  model, tokenizer = byte_model
  lm = harness.ReFusionLM(model=model, tokenizer=tokenizer, paper_task="mbpp")
  assert lm.method_value == rj.ReFusion(512, slot_size=32, serial_blocks=4, slot_threshold=0.9, token_threshold=0.3)
  lm = harness.ReFusionLM(model=model, tokenizer=tokenizer, paper_task="gsm8k_cot", gen_length=64, token_threshold=0.7)
  # A shorter answer keeps S = 32 with the most serial blocks that fit: 64 / 32 = 2 slots, NB = 2.
  assert lm.method_value == rj.ReFusion(64, slot_size=32, serial_blocks=2, slot_threshold=0.9, token_threshold=0.7)
  assert lm.method_value == rj.paper_method("gsm8k_cot", gen_length=64, token_threshold=0.7)  # as every command
  assert lm.settings == dataclasses.asdict(lm.method_value) and lm.grid == 64
  with pytest.raises(harness.HarnessArgumentError, match="multiple of slot_size × serial_blocks = 96"):
    harness.ReFusionLM(model=model, tokenizer=tokenizer, paper_task="gsm8k_cot", gen_length=64, serial_blocks=3)
  with pytest.raises(harness.HarnessArgumentError, match="slot_size: not a field of method=ar"):
    harness.ReFusionLM(model=model, tokenizer=tokenizer, method="ar", slot_size=4)
  with pytest.raises(harness.HarnessArgumentError, match="paper_task sets refusion's settings, not method=mdm's"):
    harness.ReFusionLM(model=model, tokenizer=tokenizer, method="mdm", paper_task="mbpp")
  # Every method's fields are --model_args keys, converted by their types (MDM's block and steps here).
  lm = harness.ReFusionLM(model=model, tokenizer=tokenizer, method="mdm", gen_length="32", block_length="8")
  assert lm.method_value == rj.MDM(gen_length=32, block_length=8) and lm.grid == 8


def test_max_gen_toks_is_rounded_up_to_the_slot_grid_and_capped_by_gen_length():
  assert harness.answer_length(100, 512, 8 * 64) == 512  # arc_challenge_chat: the paper's G
  assert harness.answer_length(100, 512, 32) == 128
  assert harness.answer_length(2048, 512, 64) == 512  # mmlu_pro asks for more than G
  assert harness.answer_length(None, 256, 32) == 256
  assert fitted_serial_blocks(slots=6, serial_blocks=4) == 3


def test_a_baseline_answers_within_max_gen_toks_as_its_sampler_does(byte_model):
  from lm_eval.api.instance import Instance

  model, tokenizer = byte_model
  queries = ["sort: b a", "find x: x=1"]
  requests = [Instance("generate_until", {}, (q, {"until": [], "max_gen_toks": 10}), 0) for q in queries]
  lm = harness.ReFusionLM(model=model, tokenizer=tokenizer, method="ar", gen_length=32, batch_size=2)
  texts = lm.generate_until(requests)
  (group,) = lm.stats["generate_until"].groups
  assert group["gen_length"] == 10  # AR's grid is one token
  assert texts == rj.Sampler(model, tokenizer, rj.AR(gen_length=10), rows=2).generate(queries)[0]


def test_answers_are_cut_at_each_stop_string_then_the_python_fence_is_taken(bpe):
  model, tokenizer, _ = bpe
  lm = harness.ReFusionLM(model=model, tokenizer=tokenizer, **KNOBS)
  ids = lambda text: tokenizer.encode(text)  # noqa: E731
  answer = ids("Answer: here\n```python\ndef f():\n  return 1\n```\nsort") + [tokenizer.eos_id]
  assert lm.answer_text(answer, []) == "def f():\n  return 1"
  assert lm.answer_text(answer, ["sort"]) == "def f():\n  return 1"
  assert lm.answer_text(answer, ["\n"]) == "Answer: here"
  # A stop string may be a special token: the answer is spelled with its special tokens before cutting.
  special = ids("find") + [tokenizer.encode("<|im_start|>")[0]] + ids(" code")
  assert lm.answer_text(special, ["<|im_start|>"]) == "find"
  assert lm.answer_text(special, []) == "find code"
  plain = harness.ReFusionLM(model=model, tokenizer=tokenizer, python_fence=False, **KNOBS)
  assert plain.answer_text(answer, []).startswith("Answer: here\n```python")


def test_official_tpf_averages_slots_over_each_cycles_forwards():
  S, G = 4, 16
  iteration = np.full((1, G), -1)
  phase = np.full((1, G), PHASE_NONE)
  # Cycle 0: two slots by the global verification; cycle 1: one slot after infill; cycle 2: the EOS slot (partial).
  iteration[0, :8], phase[0, :8] = 0, PHASE_VERIFY
  iteration[0, 8:12], phase[0, 8:12] = 1, PHASE_INFILL
  iteration[0, 12:14], phase[0, 12:14] = 2, PHASE_VERIFY
  # Forwards: prefill + 3 × (plan, verify) + 3 infill iterations × (draft, check) for cycle 1.
  result = DecodeResult(
    tokens=[list(range(14))],
    num_forwards=np.array([1 + 6 + 6]),
    steps=np.array([3]),
    commit_iteration=iteration,
    commit_phase=phase,
  )
  expected = (S * 2 / 2 + S * 1 / (2 + 2 * 3) + S * 1 / 2) / 3
  assert rj.ReFusion(gen_length=G, slot_size=S).official_tpf(result, 0) == pytest.approx(expected)


def test_loglikelihood_requests_name_the_generative_variants(byte_model):
  model, tokenizer = byte_model
  lm = harness.ReFusionLM(model=model, tokenizer=tokenizer)
  for call in (lm.loglikelihood, lm.loglikelihood_rolling):
    with pytest.raises(NotImplementedError, match="arc_challenge_chat.*mmlu_pro.*gpqa_main_generative_n_shot"):
      call([])


# --- the official harness -----------------------------------------------------------------------------------------

OFFICIAL = os.environ.get("REFUSION_OFFICIAL_REPO", "")


def load_official_harness(repo: str, model):
  """The official `Qwen3EvalHarness` class (eval.py), run on the CPU in float32 on our model's weights.

  eval.py is imported unchanged; what it imports is supplied as `benchmarks.official` supplies generate.py's:
  its Qwen3 model class loads our model (saved with save_hf) through `OfficialDecoder`, and the CUDA timing
  events it records become host timers. lm-eval 0.4.13 no longer has `models.utils.get_dtype`, which eval.py
  imports and never calls, and LM.device is read-only there.
  """
  import datasets  # noqa: F401  (eval.py's; imported first so that load_generate finds the real pandas)
  import lm_eval.models.utils
  import torch

  from refusion_jax.benchmarks.official import OfficialDecoder, load_generate

  generate_refusion, _ = load_generate(repo)
  decoder = OfficialDecoder(model, repo)
  decoder.eval = lambda: decoder
  decoder.to = lambda device: decoder

  class Qwen3ForCausalLM:
    @staticmethod
    def from_pretrained(path, **kwargs):
      return decoder

  class HostEvent:
    def __init__(self, enable_timing=True):
      self.time = 0.0

    def record(self):
      import time

      self.time = time.perf_counter()

    def elapsed_time(self, end):
      return (end.time - self.time) * 1000

  stubs = {
    "qwen3": types.ModuleType("qwen3"),
    "qwen3.modeling_qwen3_refusion": types.SimpleNamespace(Qwen3ForCausalLM=Qwen3ForCausalLM),
    "generate": types.SimpleNamespace(generate_refusion=generate_refusion),
  }
  saved = {name: sys.modules.get(name) for name in stubs}
  sys.modules.update(stubs)
  lm_eval.models.utils.get_dtype = getattr(lm_eval.models.utils, "get_dtype", None)
  spec = __import__("importlib.util").util.spec_from_file_location("official_eval", os.path.join(repo, "eval.py"))
  module = __import__("importlib.util").util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  finally:
    for name, previous in saved.items():
      if previous is None:
        sys.modules.pop(name, None)
      else:
        sys.modules[name] = previous
  torch.cuda.Event, torch.cuda.synchronize = HostEvent, lambda: None

  class Qwen3EvalHarness(module.Qwen3EvalHarness):
    device = None  # lm-eval 0.4.13 made LM.device a read-only property, which eval.py (for 0.4.9) assigns

  return Qwen3EvalHarness


@pytest.mark.slow  # the official decoder, one prompt at a time on the CPU (~1 min)
@pytest.mark.skipif(not os.path.isfile(os.path.join(OFFICIAL, "eval.py")), reason="set REFUSION_OFFICIAL_REPO")
def test_official_harness_gives_our_texts(tmp_path, bpe, monkeypatch):
  """20 requests with stop strings (a special token among them) through the official
  `Qwen3EvalHarness.generate_until` and ours: the same texts, and the official TPF."""
  pytest.importorskip("torch")
  pytest.importorskip("accelerate")
  from lm_eval.api.instance import Instance

  model, tokenizer, directory = bpe
  official_class = load_official_harness(OFFICIAL, model)
  knobs = dict(gen_length=32, slot_size=4, serial_blocks=2, slot_threshold=0.6, token_threshold=0.5)
  stats_dir = tmp_path / "official"
  official = official_class(
    model_path=str(directory),
    mask_id=tokenizer.mask_id,
    device="cpu",
    save_dir=str(stats_dir),
    gen_length=knobs["gen_length"],
    slot_size=knobs["slot_size"],
    serial_num_blocks=knobs["serial_blocks"],
    slot_threshold=knobs["slot_threshold"],
    token_threshold=knobs["token_threshold"],
    mc_num=1,
    batch_size=1,
  )
  rng = np.random.default_rng()
  docs = read_jsonl(FIXTURES / "refusion_tasks.jsonl")
  stops = [["\n"], ["<|im_start|>", "sort"], [" a", "="], []]
  requests = [
    Instance(
      "generate_until",
      doc={},
      arguments=(docs[i]["query"], {"until": stops[n % len(stops)]}),
      idx=0,
      metadata=("official", n, 1),
    )
    for n, i in enumerate(rng.choice(len(docs), 20, replace=False))
  ]
  theirs = official.generate_until(requests)
  ours_lm = harness.ReFusionLM(
    model=model, tokenizer=tokenizer, batch_size=4, stats_dir=str(tmp_path / "ours"), **knobs
  )
  ours = ours_lm.generate_until(requests)
  assert ours == theirs
  assert sum(len(t) for t in ours) > 0
  their_stats = json.loads((stats_dir / "final_stats.json").read_text())
  our_stats = json.loads((tmp_path / "ours" / "official" / "final_stats.json").read_text())
  assert our_stats["total_tokens"] == their_stats["total_tokens"]
  # Ours spreads an answer's infill iterations evenly over its infill cycles (`official_tpf`); exact when equal.
  assert our_stats["TPF"] == pytest.approx(their_stats["TPF"], rel=0.1)
  print(
    f"20 requests, same texts; official-definition TPF: official {their_stats['TPF']:.4f}, ours {our_stats['TPF']:.4f}"
  )
