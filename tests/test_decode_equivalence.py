"""The jitted decoder gives the eager reference's decode, token for token.

Hundreds of random cases (random tiny models, prompts, thresholds, slot
layouts and EOS ids) are decoded by both `rj.decode` and
`refusion_jax.decoding.reference.decode_reference`; tokens, forwards, plan
steps and the commit trace must agree exactly. Branch counters collected from
the reference prove that every path of docs/method.md §2 was exercised.
"""

import collections

import numpy as np
import pytest
from helpers.decode_cases import Group, decode_as_reference, random_case, same_decode

from refusion_jax.decoding.loop import compile_count
from refusion_jax.decoding.reference import decode_reference

GROUPS = [
  Group("one block", vocab_size=16, gen_length=16, slot_size=4, serial_blocks=1, cases=35),
  Group("two blocks", vocab_size=24, gen_length=16, slot_size=4, serial_blocks=2, cases=35),
  Group(
    "pairs, three blocks, qwen2",
    vocab_size=20,
    gen_length=24,
    slot_size=2,
    serial_blocks=3,
    architecture="qwen2",
    cases=30,
  ),
  Group(
    "slots of 8, llama", vocab_size=32, gen_length=32, slot_size=8, serial_blocks=2, architecture="llama", cases=25
  ),
  Group("single-token slots", vocab_size=16, gen_length=8, slot_size=1, serial_blocks=2, cases=25),
  Group("batched", vocab_size=16, gen_length=16, slot_size=4, serial_blocks=2, batch=3, max_prompt=30, cases=25),
  Group("sampled", vocab_size=24, gen_length=16, slot_size=4, serial_blocks=1, sample=True, cases=30),
]


@pytest.fixture(scope="module")
def sweep():
  """Decode every case both ways; returns mismatches per group and the branch counters."""
  rng = np.random.default_rng(20240613)
  stats = collections.Counter()
  mismatches = {}
  compiles_before = compile_count("refusion")
  for group in GROUPS:
    template = group.template()
    mismatches[group.name] = []
    for index in range(group.cases):
      case = random_case(group, template, rng)
      jitted = decode_as_reference(case.model, case.prompts, case.knobs)
      for row, prompt in enumerate(case.prompts):
        reference = decode_reference(case.model, prompt, stats=stats, **case.knobs)
        diffs = same_decode(jitted, reference, row_a=row)
        if diffs:
          mismatches[group.name].append(f"case {index} row {row} {case.knobs}: " + "; ".join(diffs))
      stats["rows_finished_early"] += int(np.sum(jitted.num_forwards < jitted.num_forwards.max()))
      stats["answers_with_eos"] += sum(case.knobs["eos_id"] in t for t in jitted.tokens)
      stats["cases"] += 1
  stats["compilations"] = compile_count("refusion") - compiles_before
  return mismatches, stats


@pytest.mark.parametrize("group", [g.name for g in GROUPS])
def test_jitted_decoder_matches_reference(sweep, group):
  mismatches, _ = sweep
  assert not mismatches[group], "\n".join(mismatches[group][:5])


def test_sweep_covers_every_branch(sweep):
  _, stats = sweep
  print("\nbranch coverage:", dict(sorted(stats.items())))
  assert stats["cases"] >= 200
  for branch in (
    "plans_several_slots",  # several slots above slot_threshold in one plan
    "plans_forced_choice",  # none above it: the single most confident slot
    "prefix_commits",  # step 2 commits whole slots
    "prefix_commits_eos",  # step 2 finds EOS in its passing prefix
    "infill_slots_partly_accepted",  # a slot enters the infill with some tokens accepted
    "infill_slots_fully_accepted",  # ... or with all of them
    "infills_several_rounds",
    "infill_eos",  # EOS accepted inside the infill
    "infill_slots_dropped",  # chosen slots after the EOS slot dropped
    "plans_after_eos",  # slots before a found EOS still decoded
    "later_blocks",  # more than one serial block
    "rows_finished_early",  # batched: a row done while others continue
  ):
    assert stats[branch] > 0, f"no case exercised {branch}: {dict(stats)}"
  # Weights are jit arguments: one compilation per group (two where prompts span two buckets).
  assert stats["compilations"] <= len(GROUPS) + 1
