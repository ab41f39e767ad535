"""The OpenAI-compatible server (refusion_jax/serving/, python -m refusion_jax.serve) against the official `openai`
client: the Sampler's texts, streamed and not, concurrent clients, bad input, auth, disconnects, SIGTERM."""

import asyncio
import concurrent.futures
import dataclasses
import json
import queue
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from helpers.server import start

import refusion_jax as rj
from refusion_jax.decoding.batching import queue_entries
from refusion_jax.decoding.engine import Engine
from refusion_jax.decoding.refusion import ReFusion
from refusion_jax.decoding.sampler import Sampler
from refusion_jax.serving.app import create_app
from refusion_jax.serving.auth import check_authorization, server_key
from refusion_jax.serving.errors import APIError
from refusion_jax.serving.metrics import Metrics
from refusion_jax.serving.worker import DecodeWorker, Job

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
  sampler = Sampler(backbone, tokenizer, dataclasses.replace(METHOD, temperature=temperature), seed=seed)
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
  ("unknown model", dict(model="gpt-4", prompt="hi"), 400, "model"),
  ("n > 1", dict(model=MODEL, prompt="hi", n=2), 400, "n"),
  ("logprobs", dict(model=MODEL, prompt="hi", logprobs=1), 400, "logprobs"),
  ("prompt too long", dict(model=MODEL, prompt="y" * (MAX_PROMPT + 1)), 400, "prompt"),
  ("max_tokens 0", dict(model=MODEL, prompt="hi", max_tokens=0), 400, "max_tokens"),
  ("max_tokens < 0", dict(model=MODEL, prompt="hi", max_tokens=-3), 400, "max_tokens"),
  ("unknown field", dict(model=MODEL, prompt="hi", frobnicate=1), 400, "frobnicate"),
  ("too many stops", dict(model=MODEL, prompt="hi", stop=["a", "b", "c", "d", "e"]), 400, "stop"),
  ("temperature", dict(model=MODEL, prompt="hi", temperature=9), 400, "temperature"),
  ("body too large", dict(model=MODEL, prompt="z" * 70000), 413, None),
]


@pytest.mark.parametrize("name, body, status, param", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_gets_its_status_and_an_openai_error_and_the_server_answers_on(server, name, body, status, param):
  reply = _post(server, "/v1/completions", body)
  assert reply.status_code == status, reply.text
  error = reply.json()["error"]
  assert error["message"] and error["type"] and error["param"] == param
  assert _post(server, "/v1/completions", dict(model=MODEL, prompt="ok", max_tokens=4)).status_code == 200


def test_chat_refuses_logprobs_and_tools_with_an_openai_error(server, client):
  with pytest.raises(openai.BadRequestError, match="log probabilities"):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True)
  with pytest.raises(openai.BadRequestError, match="tool"):
    client.chat.completions.create(
      model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {"name": "f"}}]
    )


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
  """A started serving engine of two rows in this process, advancing one loop iteration per call."""
  backbone, tokenizer = model
  special = Sampler(backbone, tokenizer, METHOD).special_ids
  engine = Engine(backbone, METHOD, rows=2, prompt_width=16, sampling=True, **special)
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
  text = metrics.render()
  assert 'refusion_requests_total{endpoint="/v1/completions",status="200"} 1' in text
  assert "refusion_tokens_per_forward 2.5" in text and "refusion_queue_depth 3" in text
  with pytest.raises(KeyError, match="unknown counter"):
    metrics.add("nonsense", 1)


def test_serve_refuses_flags_that_do_not_go_together(capsys):
  from refusion_jax import serve

  assert serve.main(["--random_init", "tiny", "--method", "ar", "--paper_task", "gsm8k_cot"]) == 2
  assert "--paper_task" in capsys.readouterr().err
