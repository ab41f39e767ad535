"""A ladder of prompt buckets (refusion_jax/decoding/ladder.py): one engine per bucket over one placement of the
weights, each prompt in the smallest bucket that holds it, the decode of `rj.decode`, nothing compiled after each
bucket's first call."""

import numpy as np
import pytest

import refusion_jax as rj
from refusion_jax.decoding.ladder import EngineLadder, check_ladder, default_bucket_rows, default_buckets
from refusion_jax.decoding.loop import compile_count
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import init_model

VOCAB = 40
METHOD = rj.AR(gen_length=4)  # a cheap loop: what is tested is the engines around it


def test_the_default_ladder_grows_by_four_and_shrinks_rows_past_1024_tokens():
  assert default_buckets(64) == (64,)
  assert default_buckets(1000) == (64, 256, 1000)
  assert default_buckets(40448) == (64, 256, 1024, 4096, 16384, 40448)
  # K = 8 rows where a bucket's cache holds at most 8 x (1024 + G) tokens, fewer above, at least 1.
  assert default_bucket_rows((64, 256, 1024, 4096, 16384), 8, 32) == (8, 8, 8, 2, 1)


@pytest.mark.parametrize("buckets, rows", [((64, 16), (1, 1)), ((16, 16), (1, 1)), ((16, 64), (1,)), ((16,), (0,))])
def test_a_bad_ladder_is_refused_by_name(buckets, rows):
  with pytest.raises(ValueError, match="bucket"):
    check_ladder(buckets, rows)


def test_a_ladder_places_weights_once_compiles_ahead_and_decodes_mixed_lengths_as_decode():
  rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
  model = init_model(tiny(vocab_size=VOCAB, eos_token_id=VOCAB - 1), 1)
  ladder = EngineLadder(model, METHOD, rj.DecodeOptions(rows=2, prefix_cache_tokens=256), buckets=(16, 64))
  first, second = ladder.engines
  assert first._params is second._params and first._knobs is second._knobs  # the weights are placed once
  assert second.prefix_cache is first.prefix_cache is ladder.prefix_cache
  assert ladder.bucket_rows == (2, 2) and ladder.rows == 4

  def run(prompts: list[list[int]]) -> list[list[int]]:
    requests = [ladder.submit(p) for p in prompts]
    answers = {}
    while not ladder.idle:
      for request in ladder.advance(2):
        answers[request] = ladder.partial(request)
        ladder.cancel(request)
    return [answers[r] for r in requests]

  draw = lambda n: rng.integers(0, VOCAB - 1, int(n)).tolist()
  prompts = [draw(n) for n in (1, 16, 17, 64, 5, 40)]
  # The repeat goes first: behind eight random prompts, the 256-token pool could have evicted its head.
  again = [prompts[5] + draw(3)] + [draw(n) for n in rng.integers(1, 65, 8)]
  expected = [rj.decode(model, batch, METHOD, rows=2).tokens for batch in (prompts, again)]  # one program
  ladder.compile(2)  # both buckets' loops, on two threads
  before = compile_count()
  assert run(prompts) == expected[0]
  assert run(again) == expected[1]
  assert compile_count() == before
  assert ladder.prefix_cache.hits >= 32  # the last prompt's 40-token head is the first pass's
  with pytest.raises(ValueError, match="longer than the longest"):
    ladder.submit(draw(65))
