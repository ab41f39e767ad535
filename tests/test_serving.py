"""The OpenAI-compatible server (refusion_jax/serving/, python -m refusion_jax.serve) against the official `openai`
client: the Sampler's texts, streamed and not, concurrent clients, bad input, auth, disconnects, SIGTERM."""

import asyncio
import concurrent.futures
import dataclasses
import json
import pathlib
import queue
import threading
import time
import types

import httpx
import numpy as np
import openai
import pytest
from helpers.server import start

import refusion_jax as rj
from refusion_jax.data.tokenizer import ByteTokenizer
from refusion_jax.decoding.batching import queue_entries
from refusion_jax.decoding.engine import Engine
from refusion_jax.decoding.refusion import ReFusion
from refusion_jax.decoding.sampler import Sampler
from refusion_jax.serving.app import create_app
from refusion_jax.serving.auth import check_authorization, server_key
from refusion_jax.serving.errors import APIError
from refusion_jax.serving.logprobs import AnswerLogprobs
from refusion_jax.serving.metrics import Metrics
from refusion_jax.serving.server import ServerFailure, Watchdog, warm_up
from refusion_jax.serving.worker import DecodeWorker, Job, Update

KEY = "test-key-3b1f"
MODEL = "tiny-random"
METHOD = ReFusion(gen_length=32, slot_size=4)
ROWS, MAX_QUEUE, MAX_PROMPT = 4, 28, 64
SERVER_ARGS = [
  *("--random_init", "tiny", "--tokenizer", "bytes", "--gen_length", "32", "--slot_size", "4"),
  *("--batch_size", str(ROWS), "--max_queue", str(MAX_QUEUE), "--max_prompt_tokens", str(MAX_PROMPT)),
  *("--chunk_iterations", "2", "--api_key", KEY, "--max_body_bytes", "65536", "--shutdown_seconds", "20"),
]
WORDS = ["the", "cat", "sat", "on", "a", "mat", "€", "🙂", "12", "+", "=", "\n"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  server = start(SERVER_ARGS, str(tmp_path_factory.mktemp("server") / "server.log"))
  yield server
  server.terminate(60)


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model():
  model, tokenizer = rj.load("tiny", format="preset", tokenizer="bytes")  # the weights --random_init tiny serves
  return model, tokenizer


def _prompts(rng: np.random.Generator, count: int) -> list[str]:
  return ["".join(rng.choice(WORDS, size=int(rng.integers(1, 12)))) for _ in range(count)]


def _expected(model, prompt: str, temperature: float = 0.0, seed: int = 0, max_tokens: int | None = None, stop=()):
  """What the Sampler answers for `prompt`, cut as the server's contract says: max_tokens rounded up to the slot
  grid, after the EOS, before the first stop string."""
  backbone, tokenizer = model
  method = dataclasses.replace(METHOD, temperature=temperature)
  # At the server's K rows: another K rounds the logits differently, so a near-tied draw could go another way.
  sampler = Sampler(backbone, tokenizer, method, seed=seed, rows=ROWS)
  tokens = sampler.decode_ids([sampler.encode(prompt)]).tokens[0]
  limit = METHOD.gen_length if max_tokens is None else -(-max_tokens // METHOD.slot_size) * METHOD.slot_size
  tokens = tokens[: min(limit, METHOD.gen_length)]
  text = tokenizer.decode(tokens)
  cuts = [text.find(s) for s in stop if s in text]
  return text[: min(cuts)] if cuts else text


def _metrics(server) -> dict[str, float]:
  text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
  return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}


def test_completions_and_chat_give_the_samplers_texts(server, client, model):
  seed = int(np.random.default_rng().integers(1 << 30))
  rng = np.random.default_rng(seed)
  for prompt in _prompts(rng, 3):
    reply = client.completions.create(model=MODEL, prompt=prompt, temperature=0)
    assert reply.choices[0].text == _expected(model, prompt), (seed, prompt)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens == len(prompt.encode())
    assert reply.model_extra["refusion"]["forwards"] >= 1
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0)
    assert chat.choices[0].message.content == _expected(model, prompt), (seed, prompt)
  temperature, sample_seed = float(rng.uniform(0.3, 1.5)), int(rng.integers(1 << 20))
  prompt, max_tokens = _prompts(rng, 1)[0], int(rng.integers(1, 32))
  reply = client.completions.create(
    model=MODEL, prompt=prompt, temperature=temperature, seed=sample_seed, max_tokens=max_tokens
  )
  assert reply.choices[0].text == _expected(model, prompt, temperature, sample_seed, max_tokens), (seed, prompt)
  assert reply.model_extra["refusion"]["max_tokens"] == -(-max_tokens // 4) * 4


def test_streamed_chunks_join_into_the_samplers_text(server, client, model):
  seed = int(np.random.default_rng().integers(1 << 30))
  rng = np.random.default_rng(seed)
  for prompt in _prompts(rng, 3):
    temperature, sample_seed = float(rng.choice([0.0, 0.9])), int(rng.integers(1 << 20))
    stop = [_expected(model, prompt, temperature, sample_seed)[5:7] or "zz"]  # a stop string the answer holds
    chunks = list(
      client.completions.create(
        model=MODEL, prompt=prompt, temperature=temperature, seed=sample_seed, stop=stop, stream=True
      )
    )
    assert "".join(c.choices[0].text for c in chunks) == _expected(model, prompt, temperature, sample_seed, stop=stop)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and chunks[-1].usage is not None
    deltas = list(
      client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        temperature=temperature,
        seed=sample_seed,
        stream=True,
      )
    )
    text = "".join(d.choices[0].delta.content or "" for d in deltas)
    assert text == _expected(model, prompt, temperature, sample_seed), (seed, prompt)
    assert deltas[0].choices[0].delta.role == "assistant"


def test_32_concurrent_clients_get_their_texts_without_a_compilation(server, client, model):
  seed = int(np.random.default_rng().integers(1 << 30))
  rng = np.random.default_rng(seed)
  requests = [
    dict(prompt=p, temperature=float(rng.choice([0.0, 0.5, 1.2])), seed=int(rng.integers(1 << 20)))
    for p in _prompts(rng, 64)
  ]
  requests[0]["prompt"] = "x" * MAX_PROMPT  # the longest prompt the server takes
  before = _metrics(server)

  def ask(request: dict) -> str:
    stream = bool(rng.integers(2))
    reply = client.completions.create(model=MODEL, stream=stream, **request)
    return "".join(c.choices[0].text for c in reply) if stream else reply.choices[0].text

  with concurrent.futures.ThreadPoolExecutor(32) as pool:
    texts = list(pool.map(ask, requests))
  after = _metrics(server)
  for request, text in zip(requests, texts):
    assert text == _expected(model, request["prompt"], request["temperature"], request["seed"]), (seed, request)
  assert after["refusion_compilations_since_warmup"] == 0
  assert after["refusion_compilations_all_since_warmup"] == before["refusion_compilations_all_since_warmup"] == 0
  assert after['refusion_requests_total{endpoint="/v1/completions",status="200"}'] >= 64


def _post(server, path: str, body, key: str | None = KEY, **kwargs) -> httpx.Response:
  headers = {"Authorization": f"Bearer {key}"} if key else {}
  content = body if isinstance(body, (bytes, str)) else json.dumps(body)
  return httpx.post(server.url + path, content=content, headers=headers, timeout=60, **kwargs)


BAD_INPUTS = [
  ("not json", b"{'prompt': ", 400, None),
  ("unknown model", dict(model="gpt-4", prompt="hi"), 404, "model"),
  ("more answers than held", dict(model=MODEL, prompt=["a", "b"], n=ROWS + MAX_QUEUE), 400, "n"),
  ("top logprobs", dict(model=MODEL, prompt="hi", logprobs=1), 400, "logprobs"),
  ("empty prompt list", dict(model=MODEL, prompt=[]), 400, "prompt"),
  ("top_p 0", dict(model=MODEL, prompt="hi", top_p=0), 400, "top_p"),
  ("stop id outside the vocabulary", dict(model=MODEL, prompt="hi", stop_token_ids=[10**6]), 400, "stop_token_ids"),
  (
    "stream_options unstreamed",
    dict(model=MODEL, prompt="hi", stream_options={"include_usage": True}),
    400,
    "stream_options",
  ),
  ("penalty", dict(model=MODEL, prompt="hi", presence_penalty=1.0), 400, "presence_penalty"),
  ("prompt too long", dict(model=MODEL, prompt="y" * (MAX_PROMPT + 1)), 400, "prompt"),
  ("max_tokens 0", dict(model=MODEL, prompt="hi", max_tokens=0), 400, "max_tokens"),
  ("max_tokens < 0", dict(model=MODEL, prompt="hi", max_tokens=-3), 400, "max_tokens"),
  ("unknown field", dict(model=MODEL, prompt="hi", frobnicate=1), 400, "frobnicate"),
  ("too many stops", dict(model=MODEL, prompt="hi", stop=[str(i) for i in range(17)]), 400, "stop"),
  ("temperature", dict(model=MODEL, prompt="hi", temperature=9), 400, "temperature"),
  ("body too large", dict(model=MODEL, prompt="z" * 70000), 413, None),
]


@pytest.mark.parametrize("name, body, status, param", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_gets_its_status_and_an_openai_error_and_the_server_answers_on(server, name, body, status, param):
  reply = _post(server, "/v1/completions", body)
  assert reply.status_code == status, reply.text
  error = reply.json()["error"]
  assert error["message"] and error["type"] and error["param"] == param
  if name == "unknown model":
    assert error["code"] == "model_not_found"
  assert _post(server, "/v1/completions", dict(model=MODEL, prompt="ok", max_tokens=4)).status_code == 200


def test_chat_refuses_top_logprobs_and_tools_with_an_openai_error(server, client):
  hi = [{"role": "user", "content": "hi"}]
  with pytest.raises(openai.BadRequestError, match="top_logprobs: only each answer token's own"):
    client.chat.completions.create(model=MODEL, messages=hi, logprobs=True, top_logprobs=2)
  with pytest.raises(openai.BadRequestError, match="tool"):
    client.chat.completions.create(model=MODEL, messages=hi, tools=[{"type": "function", "function": {"name": "f"}}])
  with pytest.raises(openai.BadRequestError, match="tool_choice"):
    client.chat.completions.create(model=MODEL, messages=hi, tool_choice="auto")
  with pytest.raises(openai.NotFoundError, match="does not exist"):
    client.chat.completions.create(model="gpt-4o", messages=hi)


def test_the_key_is_required_everywhere_but_health(server):
  assert httpx.get(server.url + "/health").status_code == 200
  for key in (None, "wrong-key"):
    reply = _post(server, "/v1/completions", dict(model=MODEL, prompt="hi"), key=key)
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    assert httpx.get(server.url + "/metrics", headers=headers).status_code == 401
  unkeyed = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
  with pytest.raises(openai.AuthenticationError):
    unkeyed.models.list()
  assert [m.id for m in openai.OpenAI(base_url=server.url + "/v1", api_key=KEY).models.list()] == [MODEL]


def test_a_full_queue_gets_429_with_retry_after(model):
  backbone, tokenizer = model
  special = Sampler(backbone, tokenizer, METHOD).special_ids
  # One row and one queue slot, and no engine thread: the first two requests stay held, the third is refused.
  engine = DecodeWorker(
    Engine(backbone, METHOD, rows=1, prompt_width=16, sampling=True, **special),
    tokenizer,
    max_queue=1,
    chunk_iterations=1,
  )
  app = create_app(engine, tokenizer, MODEL)

  async def third_reply() -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server") as http:
      held = [asyncio.create_task(http.post("/v1/completions", json=dict(model=MODEL, prompt="a"))) for _ in range(2)]
      while engine.held < 2:
        await asyncio.sleep(0.01)
      reply = await http.post("/v1/completions", json=dict(model=MODEL, prompt="b"))
      for task in held:
        task.cancel()
      return reply

  reply = asyncio.run(third_reply())
  assert reply.status_code == 429 and reply.json()["error"]["code"] == "queue_full"
  assert int(reply.headers["retry-after"]) >= 1


def test_a_client_that_disconnects_frees_its_row(server):
  before = _metrics(server)
  for _ in range(ROWS):
    with httpx.stream(
      "POST",
      server.url + "/v1/chat/completions",
      json=dict(model=MODEL, messages=[{"role": "user", "content": "leave early"}], stream=True),
      headers={"Authorization": f"Bearer {KEY}"},
      timeout=60,
    ) as reply:
      assert next(reply.iter_lines()).startswith("data: ")  # the role's event comes first; then the client leaves
  deadline = time.monotonic() + 30
  while time.monotonic() < deadline and _metrics(server)["refusion_rows_busy"] > 0:
    time.sleep(0.1)
  after = _metrics(server)
  assert after["refusion_rows_busy"] == 0
  left = 'refusion_requests_total{endpoint="/v1/chat/completions",status="499"}'
  assert after.get(left, 0) - before.get(left, 0) >= 1
  assert _post(server, "/v1/completions", dict(model=MODEL, prompt="next", max_tokens=4)).status_code == 200


def test_metrics_show_requests_tokens_and_compilations(server):
  text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
  for name in (
    "requests_total",
    "prompt_tokens_total",
    "answer_tokens_total",
    "forwards_total",
    "tokens_per_forward",
    "queue_depth",
    "rows_busy",
    "loop_seconds_total",
    "compilations_since_warmup",
  ):
    assert f"# TYPE refusion_{name} " in text, name
  assert "request id=cmpl-" in server.log() and "first_text_s=" in server.log()


def _answer(serving, prompt: str, temperature: float, seed: int, **fields) -> tuple[str, list[int], list[float]]:
  """The text, ids and log-probabilities that this process's decode worker gives (the server's code path)."""
  updates = queue.Queue()
  job = Job(
    list(prompt.encode()), serving.token_limit(None), temperature, seed, (), updates.put, logprobs=True, **fields
  )
  serving.submit(job)
  text, tokens, logprobs, finished = "", [], [], None
  while finished is None:
    update = updates.get(timeout=300)
    assert update.error is None, update.error
    text, tokens, logprobs = text + update.text, tokens + update.tokens, logprobs + update.logprobs
    finished = update.finish_reason
  return text, tokens, logprobs


def test_n_prompt_lists_filters_16_stops_and_logprobs_answer_as_the_engine_does_and_compile_nothing(
  server, client, serving
):
  before = _metrics(server)
  seed = int(np.random.default_rng().integers(1 << 30))
  rng = np.random.default_rng(seed)
  prompts = ["the cat", "12 + 12 ="]  # within the in-process worker's prompt bucket (16)
  sample_seed, temperature = int(rng.integers(1 << 20)), float(rng.uniform(0.5, 1.5))
  filters = dict(top_k=int(rng.integers(1, 64)), top_p=float(rng.uniform(0.5, 1.0)), min_p=float(rng.uniform(0, 0.2)))
  reply = client.completions.create(
    model=MODEL,
    prompt=prompts,
    n=2,
    temperature=temperature,
    seed=sample_seed,
    top_p=filters["top_p"],
    logprobs=0,
    extra_body=dict(top_k=filters["top_k"], min_p=filters["min_p"]),
  )
  assert [c.index for c in reply.choices] == [0, 1, 2, 3]
  for p, prompt in enumerate(prompts):
    for i in range(2):  # answer i of a prompt draws with seed + i
      text, tokens, logprobs = _answer(serving, prompt, temperature, sample_seed + i, **filters)
      choice = reply.choices[2 * p + i]
      assert choice.text == text, (seed, p, i)
      # The same tokens; their log-probabilities to float32 rounding (the rows' batch and bucket differ).
      assert choice.logprobs.token_logprobs == pytest.approx(logprobs, rel=1e-5, abs=1e-5), (seed, p, i)
      assert len(choice.logprobs.tokens) == len(tokens), (seed, p, i)
      assert choice.model_extra["refusion"]["seed"] == sample_seed + i
      assert choice.model_extra["refusion"]["top_k"] == filters["top_k"]
  assert reply.usage.prompt_tokens == sum(len(p) for p in prompts)  # a prompt's answers share it
  assert reply.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in reply.choices)

  # 16 stop strings (one the greedy answer holds) and a stop id, streamed with OpenAI's usage chunk.
  prompt = "a mat"
  text, tokens, _ = _answer(serving, prompt, 0.0, 0)
  stops = [f"never{i}" for i in range(15)] + [text[3:5] or "zz"]
  chunks = list(
    client.completions.create(
      model=MODEL, prompt=prompt, temperature=0, stop=stops, stream=True, stream_options={"include_usage": True}
    )
  )
  cut = text.find(stops[-1])
  assert "".join(c.choices[0].text for c in chunks[:-1]) == (text[:cut] if cut >= 0 else text)
  assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(prompt)
  assert all(c.usage is None for c in chunks[:-1])
  stop_id = tokens[min(4, len(tokens) - 1)]
  reply = client.completions.create(
    model=MODEL, prompt=prompt, temperature=0, extra_body=dict(stop_token_ids=[stop_id])
  )
  assert reply.choices[0].text == ByteTokenizer().decode(tokens[: tokens.index(stop_id)])
  assert reply.choices[0].finish_reason == "stop"

  # Chat: each answer token's log-probability and bytes, greedy; tool_choice "none" is accepted.
  chat = client.chat.completions.create(
    model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, logprobs=True, tool_choice="none"
  )
  content = chat.choices[0].logprobs.content
  assert chat.choices[0].message.content == text
  assert bytes(b for token in content for b in token.bytes).decode("utf-8", errors="replace") == text
  assert [token.logprob for token in content] == pytest.approx(_answer(serving, prompt, 0.0, 0)[2], rel=1e-5, abs=1e-5)
  after = _metrics(server)
  assert after["refusion_compilations_since_warmup"] == before["refusion_compilations_since_warmup"] == 0
  assert after["refusion_compilations_all_since_warmup"] == 0
  for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
    assert after[f"refusion_{name}_count"] - before[f"refusion_{name}_count"] >= 7, name


def _series(server) -> set[str]:
  return set(_metrics(server))


def test_a_scan_of_1000_random_paths_leaves_the_metric_series_as_they_were(server):
  rng = np.random.default_rng()
  alphabet = list("abcdefghijklmnopqrstuvwxyz0123456789-_.%")
  with httpx.Client(base_url=server.url, timeout=60) as http:

    def scan(count: int) -> None:
      for _ in range(count):
        segments = ["".join(rng.choice(alphabet, int(rng.integers(1, 12)))) for _ in range(rng.integers(1, 4))]
        # A client resolves "." and ".." segments away (RFC 3986 §5.2.4), so "/v1/models/." is a real GET
        # /v1/models: keep such segments in the scan, made ordinary by a letter.
        path = "/" + "/".join(segment + "x" if segment in (".", "..") else segment for segment in segments)
        path = str(rng.choice([path, "/v1/models" + path, "/v1" + path]))
        headers = {"Authorization": f"Bearer {KEY}"} if rng.integers(3) else {}
        reply = http.request(str(rng.choice(["GET", "POST", "DELETE"])), path, headers=headers)
        assert reply.status_code in (401, 404, 405), (path, reply.status_code)

    for path in ("/x", "/v1/x", "/v1/models/x"):  # each kind of refusal once: the bounded series it adds
      for method in ("GET", "POST", "DELETE"):
        for headers in ({}, {"Authorization": f"Bearer {KEY}"}):
          assert http.request(method, path, headers=headers).status_code in (401, 404, 405)
    before = _series(server)
    scan(1000)
    after = _series(server)
  assert after == before
  assert any('endpoint="unmatched"' in name for name in after)


# A generate-until task of short prompts (one prompt bucket for the harness) whose `until` holds more stop strings
# than OpenAI's 4, as lm-eval sends a task's whole list.
_LM_EVAL_TASK = """
task: serving_until
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{query}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "Q:", "##", "sort", "</s>", "=="]
  max_gen_toks: 48
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def _lm_eval_answers(argv: list[str], output: pathlib.Path) -> list[str]:
  """Run lm-eval's command line (through ours) and read each doc's answer from its samples file."""
  from refusion_jax import harness

  assert harness.main([*argv, "--output_path", str(output), "--log_samples", "--seed", "0"]) == 0
  (samples,) = output.glob("*/samples_serving_until_*.jsonl")
  lines = [json.loads(line) for line in samples.read_text(encoding="utf-8").splitlines()]
  return [s["resps"][0][0] for s in sorted(lines, key=lambda s: s["doc_id"])]


@pytest.mark.extra("eval")
def test_lm_eval_against_the_server_gives_the_harness_answers(server, tmp_path, monkeypatch):
  """lm-eval's local-completions at batch size 4 (prompt lists, 6 stop strings, the server's tokenizer through its
  /tokenize) and local-chat-completions answer as `python -m refusion_jax.harness` on the same weights."""
  rng = np.random.default_rng()
  queries = ["".join(rng.choice(WORDS[:-1], size=int(rng.integers(1, 4)))) for _ in range(9)]
  data = tmp_path / "serving_until.jsonl"
  data.write_text("".join(json.dumps(dict(query=q, answer="x")) + "\n" for q in queries), encoding="utf-8")
  (tmp_path / "serving_until.yaml").write_text(_LM_EVAL_TASK.format(data=data), encoding="utf-8")
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("OPENAI_API_KEY", KEY)
  task = ["--include_path", str(tmp_path), "--tasks", "serving_until"]
  ours = _lm_eval_answers(
    ["--model_args", "checkpoint=tiny,gen_length=32,slot_size=4,batch_size=4", *task], tmp_path / "harness"
  )
  endpoint = f"model={MODEL},base_url={server.url}/v1"
  completions = ["--model_args", f"{endpoint}/completions,auth_token={KEY},max_retries=1", "--batch_size", "4"]
  assert _lm_eval_answers(["--model", "local-completions", *completions, *task], tmp_path / "api") == ours
  chat = f"{endpoint}/chat/completions,num_concurrent=4,max_retries=1"
  chat_argv = ["--model", "local-chat-completions", "--model_args", chat, "--apply_chat_template", *task]
  assert _lm_eval_answers(chat_argv, tmp_path / "chat") == ours


def test_sigterm_finishes_the_requests_held_and_exits_0(server):
  replies = []

  def ask():
    replies.append(_post(server, "/v1/completions", dict(model=MODEL, prompt="last one", temperature=0)))

  asking = threading.Thread(target=ask)
  asking.start()
  time.sleep(0.5)  # the request reaches the server first, even on a loaded machine (a 200 is as good as a 503)
  assert server.terminate(60) == 0
  asking.join()
  assert replies and replies[0].status_code in (200, 503), replies
  with pytest.raises(httpx.ConnectError):
    httpx.get(server.url + "/health", timeout=5)


@pytest.fixture(scope="module")
def serving(model):
  """A started serving engine of the server's rows in this process, advancing one loop iteration per call."""
  backbone, tokenizer = model
  special = Sampler(backbone, tokenizer, METHOD).special_ids
  # The server's K rows (as `_expected`'s): another K rounds the logits differently (near-tied draws could differ).
  engine = Engine(backbone, METHOD, rows=ROWS, prompt_width=16, sampling=True, **special)
  serving = DecodeWorker(engine, tokenizer, max_queue=64, chunk_iterations=1)
  serving.start()
  yield serving
  serving.stop(30)


def _job(serving, prompt: str, deliver) -> Job:
  return Job(list(prompt.encode()), serving.token_limit(None), 0.0, 0, (), deliver)


def test_a_request_whose_delivery_fails_ends_alone(serving, model):
  updates = queue.Queue()

  def explode(update):
    raise RuntimeError("this client's side broke")

  serving.submit(_job(serving, "first", explode))
  serving.submit(_job(serving, "second", updates.put))
  texts, finished = [], None
  while finished is None:
    update = updates.get(timeout=120)
    assert update.error is None
    texts.append(update.text)
    finished = update.finish_reason
  assert "".join(texts) == _expected(model, "second")


def test_more_requests_than_queue_entries_wait_on_the_host_and_all_finish(serving, model):
  entries = queue_entries(serving.engine.rows)
  prompts = [f"request {i}" for i in range(entries + 6)]
  updates = {prompt: queue.Queue() for prompt in prompts}
  for prompt in prompts:
    serving.submit(_job(serving, prompt, updates[prompt].put))
  for prompt in prompts:
    texts, finished = [], None
    while finished is None:
      update = updates[prompt].get(timeout=300)
      assert update.error is None, update.error
      texts.append(update.text)
      finished = update.finish_reason
    assert "".join(texts) == _expected(model, prompt), prompt


def test_a_cancelled_request_frees_its_row_at_the_next_boundary(serving):
  updates = []
  job = _job(serving, "cancel me", updates.append)
  serving.submit(job)
  while job.admitted is None:
    time.sleep(0.001)
  serving.cancel(job)
  deadline = time.monotonic() + 30
  while time.monotonic() < deadline and not serving.engine.idle:
    time.sleep(0.01)
  assert serving.engine.idle and serving.rows_busy == 0
  assert not [u for u in updates if u.finish_reason or u.error]


def test_a_non_streamed_request_whose_client_leaves_frees_its_row_within_one_loop_call(serving):
  app = create_app(serving, ByteTokenizer(), MODEL)
  body = json.dumps(dict(model=MODEL, prompt="leave", max_tokens=32)).encode()
  headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
  scope = dict(type="http", method="POST", path="/v1/completions", raw_path=b"/v1/completions", query_string=b"")
  scope.update(asgi={"version": "3.0"}, http_version="1.1", scheme="http", root_path="", headers=headers)
  scope.update(client=("127.0.0.1", 1), server=("server", 80))

  async def leave() -> tuple[int, int]:
    left, messages, sent = asyncio.Event(), [dict(type="http.request", body=body, more_body=False)], []

    async def receive() -> dict:
      if messages:
        return messages.pop()
      await left.wait()
      return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
      sent.append(message)

    answering = asyncio.create_task(app(scope, receive, send))
    while serving.rows_busy == 0:  # its row has begun decoding it
      await asyncio.sleep(0.001)
    calls = serving.engine.loop_calls
    left.set()
    await asyncio.wait_for(answering, 60)
    while not serving.engine.idle:
      await asyncio.sleep(0.001)
    return sent[0]["status"], serving.engine.loop_calls - calls

  status, calls = asyncio.run(leave())
  assert status == 499  # the client left before its answer ended
  assert calls <= 2  # the call in flight, and at most one more begun before the cancel arrived


class _Killed(BaseException):
  """What the test kills the engine thread with (no `except Exception` stops it)."""


class _FakeEngine:
  """Just enough of an `Engine` for a `DecodeWorker`; each loop call runs `call` (which may hang or kill)."""

  def __init__(self, call):
    self.call, self.rows, self.prompt_width = call, 1, 16
    self.decoder = types.SimpleNamespace(method=METHOD, eos_id=ByteTokenizer.eos_id)
    self.config = types.SimpleNamespace(vocab_size=ByteTokenizer.vocab_size)

  def submit(self, prompt_ids, **sampling) -> int:
    return 0

  def advance(self, iterations: int) -> list[int]:
    self.call()
    return []

  def cancel(self, request: int) -> None:
    pass

  def partial(self, request: int) -> list[int]:
    return []

  def forwards(self, request: int) -> int:
    return 1


def _health(app) -> httpx.Response:
  async def get() -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server") as http:
      return await http.get("/health")

  return asyncio.run(get())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_is_503_once_the_engine_thread_is_killed_and_the_watchdog_ends_the_server():
  def kill():
    raise _Killed("killed by the test")

  worker = DecodeWorker(_FakeEngine(kill), ByteTokenizer(), max_queue=4, chunk_iterations=1)
  app = create_app(worker, ByteTokenizer(), MODEL)
  worker.start()
  assert _health(app).status_code == 200
  failures, updates = queue.Queue(), queue.Queue()
  watchdog = Watchdog(worker, 300.0, failures.put, period=0.01).start()
  worker.submit(Job([1, 2, 3], 4, 0.0, 0, (), updates.put))
  reason = failures.get(timeout=60)  # the watchdog saw the death and ended the server
  assert "thread died" in reason and "killed by the test" in reason
  reply = _health(app)
  assert reply.status_code == 503 and reply.json() == {"status": "unhealthy", "reason": reason}
  assert updates.get(timeout=10).error.status == 503  # the request it held got an answer
  with pytest.raises(APIError, match="stopped"):
    worker.submit(Job([1], 4, 0.0, 0, (), updates.put))
  watchdog.stop()


def test_health_is_503_while_a_loop_call_hangs_past_the_watchdog():
  release = threading.Event()
  worker = DecodeWorker(_FakeEngine(lambda: release.wait(60)), ByteTokenizer(), max_queue=4, chunk_iterations=1)
  app = create_app(worker, ByteTokenizer(), MODEL, watchdog_seconds=0.05)
  worker.start()
  try:
    worker.submit(Job([1, 2, 3], 4, 0.0, 0, (), lambda update: None))
    deadline = time.monotonic() + 60
    while worker.liveness(0.05) is None and time.monotonic() < deadline:
      time.sleep(0.01)
    reply = _health(app)
    assert reply.status_code == 503 and "has not returned" in reply.json()["reason"]
  finally:
    release.set()
    worker.stop(30)


def test_a_failed_warm_up_stops_the_start_with_its_cause_and_status_1(monkeypatch, capsys):
  from refusion_jax import serve

  class FailingWorker:
    max_prompt_tokens, max_queue, held = 16, 4, 0
    engine = types.SimpleNamespace(rows=1, buckets=(16,))

    def token_limit(self, max_tokens):
      return 4

    def submit(self, *jobs):
      for job in jobs:
        job.deliver(Update(error=APIError(500, "the device ran out of memory")))

    def cancel(self, job):
      pass

    def liveness(self, timeout):
      return None

  with pytest.raises(ServerFailure, match="the warm-up failed: the device ran out of memory"):
    warm_up(FailingWorker(), ByteTokenizer.vocab_size)

  def fail(*args, **kwargs):
    raise ServerFailure("the warm-up failed: the device ran out of memory")

  monkeypatch.setattr(serve, "build_server", fail)
  assert serve.main(["--random_init", "tiny", "--tokenizer", "bytes"]) == 1
  assert "error: the warm-up failed: the device ran out of memory" in capsys.readouterr().err


# --- the parts on their own -------------------------------------------------------------------------------


def test_the_key_is_compared_whole_and_read_from_the_environment(monkeypatch):
  check_authorization(f"Bearer {KEY}", KEY)
  check_authorization(None, None)  # an open server
  for header in (None, KEY, f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", f"Basic {KEY}"):
    with pytest.raises(APIError) as refused:
      check_authorization(header, KEY)
    assert refused.value.status == 401
  monkeypatch.setenv("REFUSION_API_KEY", "from-env")
  assert server_key(None) == "from-env" and server_key("flag") == "flag"
  with pytest.raises(ValueError, match="empty"):
    server_key(" ")


def test_metrics_render_in_prometheus_text():
  metrics = Metrics({"queue_depth": ("waiting", lambda: 3)})
  metrics.count_request("/v1/completions", 200)
  metrics.add("answer_tokens_total", 10)
  metrics.add("forwards_total", 4)
  metrics.observe("time_to_first_token_seconds", 0.03)
  metrics.observe("inter_token_latency_seconds", 0.2, count=3)
  text = metrics.render()
  assert 'refusion_requests_total{endpoint="/v1/completions",status="200"} 1' in text
  assert "refusion_tokens_per_forward 2.5" in text and "refusion_queue_depth 3" in text
  assert "# TYPE refusion_time_to_first_token_seconds histogram" in text
  assert 'refusion_time_to_first_token_seconds_bucket{le="0.02"} 0' in text
  assert 'refusion_time_to_first_token_seconds_bucket{le="0.04"} 1' in text
  assert 'refusion_inter_token_latency_seconds_bucket{le="+Inf"} 3' in text
  assert "refusion_inter_token_latency_seconds_count 3" in text
  with pytest.raises(KeyError, match="unknown counter"):
    metrics.add("nonsense", 1)
  with pytest.raises(KeyError, match="unknown histogram"):
    metrics.observe("nonsense", 1)


def test_logprobs_go_out_with_the_text_that_covers_them():
  tokenizer = ByteTokenizer()
  text = "a€bSTOP"  # a stop string "STOP" cuts the answer after "a€b"
  ids = tokenizer.encode(text) + [tokenizer.eos_id]
  answer = AnswerLogprobs(tokenizer)
  answer.add(ids, [-float(i) for i in range(len(ids))])
  given = lambda tokens: [(t.token, t.offset) for t in tokens]  # noqa: E731
  assert given(answer.take("a", final=False)) == [(97, 0)]
  assert given(answer.take("a", final=False)) == []  # the cut euro sign waits for its last byte
  assert given(answer.take("a€", final=False)) == [(0xE2, 1), (0x82, 1), (0xAC, 1)]  # all begin where € does
  assert given(answer.take("a€b", final=True)) == [(98, 2)]  # not the stop string's tokens
  whole = AnswerLogprobs(tokenizer)
  whole.add(ids, [0.0] * len(ids))
  assert [t.token for t in whole.take(text, final=True)] == ids  # the closing EOS too
  invalid = AnswerLogprobs(tokenizer)  # bytes that are no character at all stay U+FFFD, one character each
  invalid.add([0xFF, 0xFE, 56], [-1.0, float("-inf"), -2.0])
  tokens = invalid.take("\ufffd\ufffd", final=True)
  assert [(t.offset, t.logprob) for t in tokens] == [(0, -1.0), (1, -9999.0)]


def test_serve_refuses_flags_that_do_not_go_together(capsys):
  from refusion_jax import serve

  assert serve.main(["--random_init", "tiny", "--method", "ar", "--paper_task", "gsm8k_cot"]) == 2
  assert "--paper_task" in capsys.readouterr().err
