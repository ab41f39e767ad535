"""The shared-prefix cache (refusion_jax/decoding/prefix_cache.py): prompts that begin alike reuse the KV of the
prefix, and every decode is exactly the decode without the cache, for every method, under eviction and with stale
plans; its host index is a bounded LRU over block chains."""

import textwrap

import numpy as np
import pytest
from helpers.decode_cases import random_weights, same_decode
from helpers.fake_devices import run_json

import refusion_jax as rj
from refusion_jax.decoding.prefix_cache import PREFIX_BLOCK_TOKENS as BLOCK
from refusion_jax.decoding.prefix_cache import PrefixCache
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import init_model

VOCAB = 48
MASK = VOCAB - 1
METHODS = {
  "refusion": rj.ReFusion(gen_length=8, slot_size=4, slot_threshold=0.5, token_threshold=0.5),
  "ar": rj.AR(gen_length=6, temperature=0.8),  # sampled: the noise must not depend on the cache either
  "mdm": rj.MDM(gen_length=8, steps=8),
}


def _setup(seed: int):
  """A random tiny model and prompts that share prefixes: a header of 2.5 blocks with different tails, the header
  cut at and around block boundaries, a repeated prompt, and an unrelated one."""
  rng = np.random.default_rng(seed)
  config = tiny(vocab_size=VOCAB, mask_token_id=MASK, eos_token_id=int(rng.integers(VOCAB - 1)))
  model = random_weights(init_model(config), seed, weight_std=0.3, head_std=float(rng.uniform(0.5, 1.2)))
  draw = lambda n: rng.integers(0, VOCAB - 1, n).tolist()
  header = draw(2 * BLOCK + BLOCK // 2)
  prompts = [header + draw(int(rng.integers(1, 9))) for _ in range(4)]
  prompts += [header[: BLOCK + 1], header[:BLOCK], header[: 2 * BLOCK], prompts[0], draw(20), header + draw(3)]
  return model, prompts


@pytest.mark.parametrize("name", sorted(METHODS))
def test_the_prefix_cache_changes_no_decode(name):
  seed = int(np.random.default_rng().integers(1 << 30))
  model, prompts = _setup(seed)
  method = METHODS[name]
  off = rj.decode(model, prompts, method, rows=3, seed=seed)
  # A pool of 3 blocks: prompts evict each other's blocks while later ones are queued with plans to read them.
  engine = rj.Engine(model, method, rows=3, seed=seed, prompt_width=64, prefix_cache_tokens=3 * BLOCK)
  on = engine.run(prompts)
  for row in range(len(prompts)):
    assert not same_decode(off, on, row, row), (seed, row, same_decode(off, on, row, row))
  stats = engine.prefix_cache.stats
  assert stats["prefix_cache_blocks_used"] <= 3
  if name == "mdm":  # no prefill: nothing to reuse, nothing counted
    assert stats["prefix_cache_hits"] == stats["prefix_cache_queries"] == 0
  else:
    assert 0 < stats["prefix_cache_hits"] < stats["prefix_cache_queries"] == sum(map(len, prompts)), seed
    assert stats["prefix_cache_hits"] % BLOCK == 0


def test_a_sampler_reuses_a_repeated_prompt_across_calls():
  model, prompts = _setup(0)
  special = dict(mask_id=MASK, eos_id=model.config.eos_token_id, pad_id=0)  # ids of this vocabulary, not the bytes'
  sampler = rj.Sampler(model, "bytes", METHODS["ar"], rows=1, prefix_cache_tokens=256, **special)
  first = sampler.decode_ids(prompts[:2])  # the first prompt prefills all, the second reuses the shared header
  assert sampler.prefix_cache.hits == 2 * BLOCK
  again = sampler.decode_ids(prompts[:1])  # the first prompt again, from the cache this time: the same answer
  assert sampler.prefix_cache.hits == 4 * BLOCK
  assert not same_decode(first, again)


_ON_A_MESH = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import numpy as np
    import refusion_jax as rj

    model, _ = rj.load("tiny", format="preset", tokenizer="bytes")
    rng = np.random.default_rng(int(sys.argv[1]))
    header = rng.integers(0, 256, 40).tolist()
    prompts = [header + rng.integers(0, 256, int(n)).tolist() for n in rng.integers(1, 9, 5)]
    method = rj.AR(gen_length=4)
    single = rj.decode(model, prompts, method, rows=2)
    mesh = rj.make_mesh({"data": 2, "tensor": 2})  # rows over data; the pool over tensor, as the cache
    engine = rj.Engine(model, method, rows=2, prompt_width=64, mesh=mesh, prefix_cache_tokens=256)
    sharded = engine.run(prompts)
    print(json.dumps(dict(single=single.tokens, sharded=sharded.tokens, hits=engine.prefix_cache.hits)))
""")


@pytest.mark.slow  # two compilations in a process of 4 fake devices (~30 s of CPU)
def test_on_a_mesh_the_pool_serves_rows_split_over_devices():
  out = run_json(_ON_A_MESH, str(np.random.default_rng().integers(1 << 20)))
  assert out["sharded"] == out["single"] and out["hits"] >= 4 * 2 * BLOCK


def _cache(blocks: int) -> PrefixCache:
  return PrefixCache(tiny(), blocks * BLOCK)


def test_the_index_reads_leading_blocks_and_leaves_the_last_token_to_prefill():
  cache = _cache(8)
  prompt = list(range(3 * BLOCK))
  first = cache.plan(prompt, 4)
  assert first.cached == 0 and (first.slot[:3] >= 0).all() and first.slot[3] == -1  # three blocks to write
  again = cache.plan(prompt, 4)
  # The third block is cached but not read: the prompt's last token is prefilled (it gives the first logits).
  assert again.cached == 2 and again.slot[2] == -1 and not again.allocated
  assert list(again.slot[:2]) == list(first.slot[:2]) and list(again.generation[:2]) == list(first.generation[:2])
  other = cache.plan(prompt[:BLOCK] + [99] * (2 * BLOCK), 4)
  assert other.cached == 1 and len(other.allocated) == 2


def test_the_index_is_bounded_and_evicts_the_least_recently_used_deepest_first():
  cache = _cache(3)
  a, b = list(range(2 * BLOCK)), list(range(100, 100 + 2 * BLOCK))
  plan_a = cache.plan(a + [0], 4)
  cache.plan(b[:BLOCK] + [0], 4)  # b's first block: the third slot
  cache.plan(b + [0], 4)  # b's second block evicts a's second block (a's deepest), not a's first
  assert cache.used_blocks == 3
  assert cache.plan(a[:BLOCK] + [0], 4).cached == 1
  again = cache.plan(a + [0], 4)
  assert again.cached == 1 and again.allocated and again.generation[1] != plan_a.generation[1]


def test_a_prompt_dropped_before_its_admission_forgets_its_blocks():
  cache = _cache(4)
  plan = cache.plan(list(range(2 * BLOCK + 1)), 4)
  cache.discard(plan)
  assert cache.used_blocks == 0 and cache.plan(list(range(2 * BLOCK + 1)), 4).cached == 0


@pytest.mark.parametrize("tokens", [0, BLOCK - 1, -5])
def test_a_prefix_cache_too_small_is_refused_by_name(tokens):
  if tokens == 0:
    assert rj.DecodeOptions(prefix_cache_tokens=0).prefix_cache_tokens == 0
    return
  with pytest.raises(ValueError, match="prefix_cache_tokens"):
    rj.DecodeOptions(prefix_cache_tokens=tokens)
