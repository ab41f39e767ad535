"""A method the package does not ship (`helpers/toy_method.py`, one file) runs everywhere a shipped one does.

The toy `Strided` decodes AR's tokens `stride` at a time, so each path is
checked against `rj.AR` or against the toy's own `rj.decode`: `rj.decode` and
`Engine`, `Sampler` with continuous batching (no recompiles), a mesh of 8 fake
CPU devices, the eval command, the lm-eval harness and the HTTP server, with
no edit outside the toy's file (docs/architecture.md §4, "Adding a method").
"""

import asyncio
import json
import os
import textwrap

import httpx
import numpy as np
import pytest
from helpers.fake_devices import run_json
from helpers.toy_method import Strided

import refusion_jax as rj
from refusion_jax import eval as eval_cli
from refusion_jax.data.tokenizer import ByteTokenizer
from refusion_jax.decoding.methods import METHODS
from refusion_jax.model.config import tiny

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS = 258
CONFIG = tiny(vocab_size=260, mask_token_id=259, pad_token_id=256, eos_token_id=EOS)


@pytest.fixture(scope="module")
def model():
  return rj.init_model(CONFIG, seed=int(np.random.default_rng().integers(1 << 20)))


def prompts(rng, count):
  return [rng.integers(0, 256, rng.integers(2, 14)).tolist() for _ in range(count)]


def test_decode_gives_ars_tokens_stride_at_a_time_greedy_and_sampled(model):
  rng = np.random.default_rng()
  ids = prompts(rng, 5)
  greedy = rj.decode(model, ids, Strided(gen_length=8, stride=2))
  reference = rj.decode(model, ids, rj.AR(gen_length=8))
  assert greedy.tokens == reference.tokens
  assert (greedy.num_forwards == reference.num_forwards).all()
  assert (greedy.steps < reference.steps).all()  # fewer loop iterations: 2 tokens each
  seed = int(rng.integers(1000))
  sampled = rj.decode(model, ids, Strided(gen_length=8, stride=4, temperature=1.0), rj.DecodeOptions(rows=2, seed=seed))
  assert sampled.tokens == rj.decode(model, ids, rj.AR(gen_length=8, temperature=1.0), seed=seed).tokens


def test_sampler_batches_continuously_without_recompiling(model):
  rng = np.random.default_rng()
  method = Strided(gen_length=8, stride=2)
  sampler = rj.Sampler(model, ByteTokenizer(), method, rows=2, eos_id=EOS)
  texts = ["".join(chr(97 + int(c)) for c in rng.integers(0, 26, rng.integers(2, 12))) for _ in range(5)]
  answers, result = sampler.generate(texts)
  singles = [rj.decode(model, [ByteTokenizer().encode(t)], method, eos_id=EOS).tokens[0] for t in texts]
  assert result.tokens == singles
  before = rj.compile_count("strided")
  sampler.generate(texts[:3])  # another prompt count, the same rows and bucket
  assert rj.compile_count("strided") == before


_ON_A_MESH = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
    import numpy as np
    import refusion_jax as rj
    from helpers.toy_method import Strided
    from refusion_jax.model.config import tiny

    model = rj.init_model(tiny(vocab_size=260, mask_token_id=259, pad_token_id=256, eos_token_id=258), seed=3)
    rng = np.random.default_rng(int(sys.argv[1]))
    ids = [rng.integers(0, 256, rng.integers(2, 12)).tolist() for _ in range(5)]
    method = Strided(gen_length=8, stride=2)
    single = rj.decode(model, ids, method)
    mesh = rj.make_mesh({"data": 4, "fsdp": 2})
    sharded = rj.decode(model, ids, method, rj.DecodeOptions(mesh=mesh, rows=3, chunk_iterations=1))
    print(json.dumps(dict(single=single.tokens, sharded=sharded.tokens)))
""")


def test_a_mesh_of_fake_devices_gives_the_single_device_tokens():
  out = run_json(_ON_A_MESH, str(np.random.default_rng().integers(1 << 20)))
  assert out["sharded"] == out["single"]


def test_the_eval_command_knows_it_by_name(tmp_path, capsys, model):
  assert METHODS["strided"] is Strided  # registered by importing its file
  rng = np.random.default_rng()
  queries = ["".join(chr(97 + int(c)) for c in rng.integers(0, 26, rng.integers(2, 10))) for _ in range(4)]
  data = tmp_path / "test.json"
  data.write_text(json.dumps([{"query": q, "response": "x"} for q in queries]))
  out = tmp_path / "strided.json"
  argv = ["--checkpoint", "tiny", "--tokenizer", "bytes", "--config", os.path.join(REPO, "configs", "demo.py")]
  argv += ["--data", str(data), "--method", "strided", "--stride", "4", "--gen_length", "8", "--rows", "2"]
  assert eval_cli.main(argv + ["--out", str(out), "--no_progress"]) == 0, capsys.readouterr().err
  record = json.loads(out.read_text())
  assert record["method"] == "strided" and record["label"] == "strided k4"
  loaded, tokenizer = rj.load("tiny", tokenizer="bytes")
  chat = eval_cli.read_config(argv[5]).data.chat_template
  expected = rj.Sampler(loaded, tokenizer, Strided(gen_length=8, stride=4), chat_template=chat).generate(queries)[0]
  assert {a["query"]: a["answer"] for a in record["answers"]} == dict(zip(queries, expected))


@pytest.mark.extra("eval")
def test_the_harness_takes_its_fields_and_grid(model):
  from lm_eval.api.instance import Instance

  from refusion_jax.evaluation.harness import ReFusionLM, check_model_args, model_arg_names

  assert "stride" in model_arg_names()
  check_model_args({"method": "strided", "stride": "2"})  # accepted before anything loads
  lm = ReFusionLM(model=model, tokenizer="bytes", method="strided", stride="4", gen_length="16", batch_size=2)
  assert lm.grid == 4 and lm.method_value == Strided(gen_length=16, stride=4)
  contexts = ["abc", "hello there", "xy"]
  requests = [
    Instance("generate_until", {}, (c, {"until": [], "max_gen_toks": 5}), i, task_name="toy")
    for i, c in enumerate(contexts)
  ]
  answers = lm.generate_until(requests, disable_tqdm=True)
  # max_gen_toks 5 rounds up to the toy's grid: 8 tokens each.
  expected = rj.Sampler(model, "bytes", Strided(gen_length=8, stride=4), rows=2).generate(contexts)[0]
  assert answers == expected


def test_the_server_answers_with_it(model):
  from refusion_jax.serving.app import create_app
  from refusion_jax.serving.server import ServerOptions, start_worker

  method = Strided(gen_length=8, stride=4)
  options = ServerOptions(method, rj.DecodeOptions(rows=2, chunk_iterations=1), 16, 4, "toy")
  worker = start_worker(model, ByteTokenizer(), options)
  app = create_app(worker, ByteTokenizer(), "toy")

  async def complete(prompt: str, max_tokens: int) -> dict:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server") as http:
      reply = await http.post("/v1/completions", json=dict(model="toy", prompt=prompt, max_tokens=max_tokens))
      assert reply.status_code == 200, reply.text
      return reply.json()

  try:
    reply = asyncio.run(complete("hello", 3))
  finally:
    worker.stop(30)
  result = rj.Sampler(model, ByteTokenizer(), method).generate(["hello"])[1]
  assert reply["usage"]["completion_tokens"] == 4  # max_tokens 3 rounded up to the toy's token grid
  # compared as the same 4 tokens' text: a cut inside a multi-byte character decodes to replacement characters
  assert reply["choices"][0]["text"] == ByteTokenizer().decode(result.tokens[0][:4])
