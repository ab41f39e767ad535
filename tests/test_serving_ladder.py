"""The server's ladder of prompt buckets and its prefix cache (docs/serving.md, "Prompt buckets", "The prefix
cache"), through the `openai` client: a prompt as long as the model's context allows is answered as the Sampler
answers it, prompts of mixed lengths compile nothing after the warm-up, and a repeated prompt reuses its KV."""

import concurrent.futures

import httpx
import numpy as np
import openai
import pytest
from helpers.server import start

import refusion_jax as rj

MODEL, GEN = "tiny-random", 8
LONGEST = 1000
SERVER_ARGS = [
  *("--random_init", "tiny", "--tokenizer", "bytes", "--method", "ar", "--gen_length", str(GEN)),
  *("--rows", "2", "--max_queue", "32", "--max_prompt_tokens", str(LONGEST), "--chunk_iterations", "2"),
  *("--prompt_buckets", f"64,{LONGEST}"),  # two loops to compile (the default ladder: tests/test_ladder.py)
]
WORDS = ["the", "cat", "sat", "on", "a", "mat", "12", "+", "=", " "]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  server = start(SERVER_ARGS, str(tmp_path_factory.mktemp("ladder") / "server.log"))
  yield server
  server.terminate(60)


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _metrics(server) -> dict[str, float]:
  text = httpx.get(server.url + "/metrics").text
  return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}


def _text(rng: np.random.Generator, length: int) -> str:
  return "".join(rng.choice(WORDS, size=length))[:length]  # bytes: one token per character


def test_the_ladder_is_announced(server):
  metrics = _metrics(server)
  assert metrics["refusion_prompt_buckets"] == 2 and metrics["refusion_max_prompt_tokens"] == LONGEST
  assert metrics["refusion_prompt_bucket_64_rows"] == metrics["refusion_prompt_bucket_1000_rows"] == 2
  assert "buckets 64,1000" in server.log()


def test_a_1000_token_prompt_is_answered_as_the_sampler_answers_it_and_again_from_the_cache(server, client):
  prompt = _text(np.random.default_rng(), LONGEST)
  before = _metrics(server)
  reply = client.completions.create(model=MODEL, prompt=prompt, temperature=0)
  model, tokenizer = rj.load("tiny", format="preset", tokenizer="bytes")  # the weights --random_init tiny serves
  assert reply.choices[0].text == rj.Sampler(model, tokenizer, rj.AR(gen_length=GEN))(prompt)
  assert reply.usage.prompt_tokens == LONGEST and reply.usage.prompt_tokens_details.cached_tokens == 0
  again = client.completions.create(model=MODEL, prompt=prompt, temperature=0)
  assert again.choices[0].text == reply.choices[0].text
  assert again.usage.prompt_tokens_details.cached_tokens == (LONGEST - 1) // 16 * 16  # OpenAI's field says so too
  after = _metrics(server)
  # The second time, all whole blocks but the one holding the last token came from the prefix cache.
  assert after["refusion_prefix_cache_hits"] - before["refusion_prefix_cache_hits"] >= (LONGEST - 1) // 16 * 16
  with pytest.raises(openai.BadRequestError, match="at most 1000"):
    client.completions.create(model=MODEL, prompt=prompt + "x", temperature=0)


def test_mixed_lengths_compile_nothing_after_the_warm_up(server, client):
  seed = int(np.random.default_rng().integers(1 << 30))
  rng = np.random.default_rng(seed)
  lengths = [1, 63, 64, 65, 999, LONGEST, *rng.integers(1, LONGEST + 1, 16)]
  prompts = [_text(rng, int(n)) for n in lengths]

  def ask(prompt: str) -> str:
    return client.completions.create(model=MODEL, prompt=prompt, temperature=float(rng.choice([0, 0.7]))).choices[0]

  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    choices = list(pool.map(ask, prompts))
  assert all(choice.finish_reason in ("stop", "length") for choice in choices), seed
  metrics = _metrics(server)
  assert metrics["refusion_compilations_since_warmup"] == 0, seed
