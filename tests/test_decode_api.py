"""The typed decoding API: method values, `rj.decode`, the `Engine` it runs and the `Sampler` over it."""

import dataclasses
import warnings

import jax
import numpy as np
import pytest
from helpers.decode_cases import random_weights
from helpers.eager_baselines import llada_low_confidence, naive_greedy

import refusion_jax as rj
from refusion_jax.data.tokenizer import ByteTokenizer
from refusion_jax.decoding import methods
from refusion_jax.decoding.engine import Engine
from refusion_jax.decoding.loop import compile_count
from refusion_jax.decoding.reference import decode_reference
from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import init_model

VOCAB = 40
MASK, EOS = VOCAB - 1, VOCAB - 2


def random_model(seed: int, head_std: float = 1.0):
  return random_weights(init_model(tiny(vocab_size=VOCAB)), seed, weight_std=0.3, head_std=head_std)


def random_prompts(rng, count: int, longest: int = 12) -> list[list[int]]:
  return [rng.integers(0, VOCAB - 2, int(n)).tolist() for n in rng.integers(1, longest + 1, count)]


# ----------------------------------------------------------------------------- method values


def test_method_values_are_frozen_hashable_and_hold_their_defaults():
  assert rj.ReFusion() == rj.ReFusion(64, 4, 1, 0.9, 0.9, 0.0, True)
  assert rj.AR() == rj.AR(gen_length=64, temperature=0.0)
  # MDM's block and steps follow G when unset: the value says what it runs.
  assert rj.MDM(gen_length=16) == rj.MDM(gen_length=16, block_length=16, steps=16)
  assert rj.MDM(gen_length=96).block_length == 32
  values = {rj.ReFusion(), rj.ReFusion(), rj.AR(), rj.MDM()}
  assert len(values) == 3
  with pytest.raises(dataclasses.FrozenInstanceError):
    rj.ReFusion().slot_size = 8
  # The shipped methods by name (a test's registered toy may sit beside them: tests/helpers/toy_method.py).
  assert {name: methods.METHODS[name] for name in ("refusion", "ar", "mdm")} == {
    "refusion": rj.ReFusion,
    "ar": rj.AR,
    "mdm": rj.MDM,
  }


BAD_VALUES = [
  (lambda: rj.ReFusion(gen_length=10), "use gen_length=8"),
  (lambda: rj.ReFusion(slot_size=0), r"slot_size=0 must be a positive integer, e\.g\. slot_size=4"),
  (lambda: rj.ReFusion(serial_blocks=2.0), "serial_blocks=2.0 must be a positive integer"),
  (lambda: rj.ReFusion(slot_threshold=0.0), r"slot_threshold=0.0 must lie in \(0, 1\].*slot_threshold=0.9"),
  (lambda: rj.ReFusion(token_threshold="high"), "token_threshold='high'"),
  (lambda: rj.ReFusion(temperature=-1.0), "temperature=-1.0 must be >= 0"),
  (lambda: rj.ReFusion(fit_width="yes"), "fit_width='yes' must be True or False"),
  (lambda: rj.AR(gen_length=True), "gen_length=True must be a positive integer"),
  (lambda: rj.AR(temperature=-0.1), "temperature=-0.1"),
  (lambda: rj.MDM(gen_length=10, block_length=4), "multiple of block_length=4"),
  (lambda: rj.MDM(gen_length=8, block_length=4, steps=16), "at most steps=8"),
  (lambda: rj.MDM(gen_length=8, steps=0), "steps=0 must be a positive integer, e.g. steps=8"),
]


@pytest.mark.parametrize("build,message", BAD_VALUES, ids=[m for _, m in BAD_VALUES])
def test_a_bad_field_is_refused_when_the_value_is_built(build, message):
  with pytest.raises(ValueError, match=message):
    build()


def test_paper_tasks_are_refusion_values_at_g_512():
  assert all(isinstance(m, rj.ReFusion) and m.gen_length == 512 for m in rj.PAPER_TASKS.values())
  assert rj.PAPER_TASKS["gsm8k_cot"] == rj.ReFusion(512, slot_size=32, serial_blocks=4, token_threshold=0.4)


def test_a_method_from_named_values_takes_its_own_fields_and_leaves_the_rest():
  values = dict(gen_length=16, slot_size=8, block_length=4, steps=None, temperature=None)
  assert methods.method_value("refusion", values) == rj.ReFusion(gen_length=16, slot_size=8)
  assert methods.method_value("mdm", values) == rj.MDM(gen_length=16, block_length=4)
  assert methods.method_value("ar", values) == rj.AR(gen_length=16)
  with pytest.raises(ValueError, match="Unknown method 'beam'"):
    methods.method_value("beam", values)


def test_decode_refuses_what_is_not_a_method_value():
  model = random_model(0)
  for bad in ("refusion", rj.ReFusion, dict(gen_length=8)):
    with pytest.raises(ValueError, match=r"not a decoding method value.*refusion_jax.ReFusion\(gen_length=64\)"):
      rj.decode(model, [[1, 2]], bad)


# ----------------------------------------------------------------------------- rj.decode against references


def test_decode_gives_each_method_the_tokens_of_its_eager_reference():
  # LLaDA ranks confidences in float64; the jitted MDM's float32 ones within ~1e-6 (often two 1.0s) may rank the
  # other way (3 of 300 draws), so a draw with such a near-tie is drawn again (48 of 500 draws), as test_decode_fuzz
  # discards its ties.
  for _ in range(20):
    seed = int(np.random.default_rng().integers(1 << 20))
    rng = np.random.default_rng(seed)
    model = random_model(seed, head_std=float(rng.uniform(0.5, 1.5)))
    prompts, margins = random_prompts(rng, 3), []
    llada = [llada_low_confidence(model, p, 8, 4, 4, MASK, margins) for p in prompts]
    if min(margins) >= 1e-5:
      break
  else:
    raise AssertionError("20 draws in a row had a near-tie in LLaDA's ranking")
  refusion = rj.ReFusion(
    gen_length=16,
    slot_size=4,
    serial_blocks=2,
    slot_threshold=float(rng.uniform(0.2, 0.9)),
    token_threshold=float(rng.uniform(0.2, 0.9)),
  )
  got = rj.decode(model, prompts, refusion, mask_id=MASK, eos_id=EOS)
  for row, prompt in enumerate(prompts):
    want = decode_reference(model, prompt, mask_id=MASK, eos_id=EOS, **refusion.reference_fields)
    assert got.tokens[row] == want.tokens[0], f"seed {seed}, refusion row {row}"
  ar = rj.decode(model, prompts, rj.AR(gen_length=8), eos_id=EOS, rows=2)
  assert ar.tokens == [naive_greedy(model, p, 8, eos_id=EOS) for p in prompts], f"seed {seed}"
  mdm = rj.decode(model, prompts, rj.MDM(gen_length=8, block_length=4, steps=4), mask_id=MASK, eos_id=EOS)
  assert mdm.tokens == [t[: t.index(EOS) + 1] if EOS in t else t for t in llada], f"seed {seed}"


# ----------------------------------------------------------------------------- the engine


def test_the_engine_decodes_prompts_fed_one_by_one_as_decode_does_and_compiles_once():
  rng = np.random.default_rng()
  model, prompts = random_model(int(rng.integers(1 << 20)), head_std=0.7), random_prompts(rng, 5)
  method = rj.ReFusion(gen_length=16, slot_size=4, slot_threshold=0.6, token_threshold=0.4, temperature=0.5)
  expected = rj.decode(model, prompts, method, rows=2, seed=3, mask_id=MASK, eos_id=EOS)
  engine = Engine(model, method, rows=2, prompt_width=16, seed=3, mask_id=MASK, eos_id=EOS)
  before = compile_count("refusion")
  requests = [engine.submit(p) for p in prompts[:3]]
  finished, streamed = [], {r: [] for r in range(len(prompts))}
  while not engine.idle:
    finished += engine.advance(iterations=2)
    for request in requests:
      if request not in finished:
        now = engine.partial(request)
        assert now[: len(streamed[request])] == streamed[request]  # a stream only grows
        streamed[request] = now
    if len(requests) < len(prompts):  # more prompts arrive while the engine runs
      requests.append(engine.submit(prompts[len(requests)]))
  result = engine.pop(requests)
  assert result.tokens == expected.tokens
  assert [streamed[r] for r in requests if streamed[r]] == [
    result.tokens[r][: len(streamed[r])] for r in requests if streamed[r]
  ]
  assert sorted(finished) == requests
  assert compile_count("refusion") == before  # `decode` compiled this program; feeding it compiled nothing


def test_decode_places_a_model_once_and_sees_its_weights_change():
  from flax import nnx

  from refusion_jax.decoding import programs

  rng = np.random.default_rng()
  model, prompts = random_model(int(rng.integers(1 << 20)), head_std=0.7), random_prompts(rng, 3)
  method = rj.AR(gen_length=8)
  first = rj.decode(model, prompts, method, eos_id=EOS)
  placed = programs._PROGRAMS[model].programs
  assert rj.decode(model, prompts, method, eos_id=EOS).tokens == first.tokens
  assert programs._PROGRAMS[model].programs is placed and len(placed) == 1  # nothing placed again
  # New weights (an update replaces arrays) are seen at once: the tokens are those of a model built with them.
  other = random_model(int(rng.integers(1 << 20)), head_std=0.7)
  nnx.update(model, nnx.state(other))
  assert rj.decode(model, prompts, method, eos_id=EOS).tokens == rj.decode(other, prompts, method, eos_id=EOS).tokens
  assert programs._PROGRAMS[model].programs is not placed
  # So is a change of structure over the same arrays (here the head read from the tied embedding instead).
  before = rj.decode(model, prompts, method, eos_id=EOS).tokens
  model.config = model.config.replace(tie_embeddings=not model.config.tie_embeddings)
  after = rj.decode(model, prompts, method, eos_id=EOS).tokens
  assert after == rj.decode(nnx.clone(model), prompts, method, eos_id=EOS).tokens and after != before


def test_the_loop_donates_its_state_so_an_engine_holds_one_kv_cache():
  rng = np.random.default_rng()
  model, prompts = random_model(int(rng.integers(1 << 20))), random_prompts(rng, 3)
  # Without an EOS id no answer ends before its 8 tokens.
  engine = Engine(model, rj.AR(gen_length=8), rows=3, prompt_width=16)
  requests = [engine.submit(prompt) for prompt in prompts]
  engine.advance(iterations=2)
  given = engine._state  # the first call's output, the second call's input
  engine.advance(iterations=2)
  # Its KV cache became the second call's output (the queue fields the host refilled were never handed over).
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves(given.rows))
  # The compiled program aliases every byte of the state it takes to the state it returns.
  state = engine._state
  lowered = engine._loop.lower(engine._params, state, engine._iterations(2), engine._knobs)
  assert lowered.compile().memory_analysis().alias_size_in_bytes == sum(x.nbytes for x in jax.tree.leaves(state))
  while not engine.idle:
    engine.advance()
  # Later engines of the program start from the process's idle start, which no call consumed.
  decodes = [rj.decode(model, prompts, rj.AR(gen_length=8)).tokens for _ in range(2)]
  assert decodes == [engine.pop(requests).tokens] * 2


def test_a_cancelled_request_frees_its_row_for_the_others():
  rng = np.random.default_rng()
  model, prompts = random_model(int(rng.integers(1 << 20))), random_prompts(rng, 3)
  method = rj.AR(gen_length=12)
  engine = Engine(model, method, rows=1, prompt_width=16)  # the config names no EOS: every answer is 12 tokens
  first, second, third = (engine.submit(p) for p in prompts)
  engine.advance(iterations=3)
  assert len(engine.partial(first)) == 4  # the prefill's token and three steps
  engine.cancel(first)
  engine.cancel(third)  # still queued on the host
  done = []
  while not engine.idle:
    done += engine.advance()
  assert done == [second]
  assert engine.pop([second]).tokens == rj.decode(model, [prompts[1]], method).tokens
  with pytest.raises(ValueError, match="neither decoding nor finished"):
    engine.partial(first)


def test_the_engine_refuses_a_prompt_longer_than_its_bucket():
  engine = Engine(random_model(1), rj.AR(gen_length=4), rows=1, prompt_width=16)
  with pytest.raises(ValueError, match="prompt_width=32"):
    engine.submit(list(range(20)))


# ----------------------------------------------------------------------------- the sampler


def test_the_sampler_takes_a_method_value_and_its_special_ids_from_the_tokenizer():
  tok = ByteTokenizer()
  model = init_model(tiny(vocab_size=tok.vocab_size), seed=int(np.random.default_rng().integers(1 << 20)))
  method = rj.ReFusion(gen_length=8, slot_threshold=0.5, token_threshold=0.5)
  sampler = rj.Sampler(model, tok, method=method, rows=2)
  texts, result = sampler.generate(["one", "two", "three"])
  ids = [tok.encode(t) for t in ("one", "two", "three")]
  expected = rj.decode(model, ids, method, rows=2, mask_id=tok.mask_id, eos_id=tok.eos_id, pad_id=tok.pad_id)
  assert result.tokens == expected.tokens and texts == [tok.decode(t) for t in expected.tokens]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    sampler(["again"])  # the new spelling warns about nothing


@pytest.mark.parametrize(("batch_size", "loop_forwards"), [(None, 7), (1, 21)])
def test_batched_forwards_count_the_loop_and_one_prefill_per_prompt(batch_size, loop_forwards):
  from refusion_jax.benchmarks.models import random_bench_model

  bench = random_bench_model("tiny", 3, 128.0, int(np.random.default_rng().integers(1 << 20)))  # EOS never predicted
  result = rj.decode(bench.model, bench.prompts, rj.AR(gen_length=8), eos_id=bench.eos_id, rows=batch_size)
  assert result.num_forwards.tolist() == [8, 8, 8]  # a prefill and 7 steps each
  # Three rows step together (7 forwards) or one row steps 7 times per prompt; each prompt is prefilled once.
  assert result.widths["forward"] == {1: loop_forwards} and result.batched_forwards == loop_forwards + 3
