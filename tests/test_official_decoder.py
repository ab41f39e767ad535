"""The official PyTorch decoder, run from a checkout through `benchmarks.official`, gives our tokens.

Needs a checkout of ML-GSAI/ReFusion named by REFUSION_OFFICIAL_REPO (CI has
none and no network, so there it is skipped); torch and transformers are the
test references. Run it with

    REFUSION_OFFICIAL_REPO=/path/to/ReFusion python -m pytest tests/test_official_decoder.py
"""

import os

import numpy as np
import pytest
from helpers.decode_cases import decode_as_reference

from refusion_jax.benchmarks.models import random_bench_model
from refusion_jax.benchmarks.throughput import ThroughputOptions, run_throughput_bench, same_answers
from refusion_jax.decoding.refusion import ReFusion

REPO = os.environ.get("REFUSION_OFFICIAL_REPO", "")
pytestmark = pytest.mark.skipif(
  not os.path.isfile(os.path.join(REPO, "generate.py")),
  reason="set REFUSION_OFFICIAL_REPO to a checkout of ML-GSAI/ReFusion",
)


@pytest.mark.parametrize("slot_size, serial_blocks, slot_threshold", [(4, 2, 0.9), (8, 1, 0.6)])
def test_official_decoder_gives_our_tokens(slot_size, serial_blocks, slot_threshold):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from refusion_jax.benchmarks.official import OfficialDecoder

  seed = int(np.random.default_rng().integers(1 << 16))
  model = random_bench_model("tiny", 5, 64.0, seed, (6, 20), num_layers=2)
  knobs = dict(
    gen_length=32,
    slot_size=slot_size,
    serial_blocks=serial_blocks,
    slot_threshold=slot_threshold,
    token_threshold=0.5,
    mask_id=model.mask_id,
    eos_id=model.eos_id,
  )
  official = OfficialDecoder(model.model, REPO).decode(model.prompts, **knobs)
  ours = decode_as_reference(model.model, model.prompts, dict(knobs, pad_id=model.pad_id))
  assert official.tokens == ours.tokens, f"seed {seed}"
  assert all(len(t) > 0 for t in official.tokens)
  # Every official forward is counted by its query width; their sum is the forwards per prompt.
  assert sum(official.widths["forward"].values()) == int(np.sum(official.num_forwards))


def test_official_decoder_runs_in_the_model_dtype_on_our_device():
  pytest.importorskip("torch")
  from refusion_jax.benchmarks.official import OfficialDecoder

  model = random_bench_model("tiny", 1, 64.0, 0, num_layers=1, dtype="bfloat16", param_dtype="bfloat16")
  official = OfficialDecoder(model.model, REPO)
  assert str(official.dtype) == "torch.bfloat16" and official.device.type == "cpu"  # this CPU-only machine
  assert all(str(p.dtype) == "torch.bfloat16" for p in official.model.parameters())


def test_throughput_bench_compares_the_official_answers_with_ours():
  pytest.importorskip("torch")
  method = ReFusion(gen_length=8, slot_size=4, serial_blocks=1, slot_threshold=0.9, token_threshold=0.9)
  options = ThroughputOptions(method, prompts=(3,), batch_sizes=(1,), repeats=1, num_layers=1, official_repo=REPO)
  rows = run_throughput_bench(options)
  (official,) = [r for r in rows if r.official]
  sequential = next(r for r in rows if r.mode == "sequential")
  assert official.mode == "official PyTorch cpu float32" and official.rows == 1
  # float32 on the CPU: the official code gives our answers, every one.
  assert same_answers(official, sequential) == 3
