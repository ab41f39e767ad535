"""The paper's decoding settings per lm-eval task (the official eval.sh), as `ReFusion` values.

Every task decodes G = 512 tokens, zero-shot, with the chat template; the
harness (`refusion_jax.evaluation.harness`, `paper_task=`) shortens G per
request and keeps the rest. Every command merges a paper task with the
fields given beside it through `paper_method`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from refusion_jax.decoding.refusion import ReFusion

PAPER_GEN_LENGTH = 512

PAPER_TASKS: dict[str, ReFusion] = {
  "gsm8k_cot": ReFusion(PAPER_GEN_LENGTH, slot_size=32, serial_blocks=4, slot_threshold=0.9, token_threshold=0.4),
  "minerva_math": ReFusion(PAPER_GEN_LENGTH, slot_size=32, serial_blocks=8, slot_threshold=0.8, token_threshold=0.6),
  "humaneval_instruct_noprefix": ReFusion(
    PAPER_GEN_LENGTH, slot_size=32, serial_blocks=4, slot_threshold=0.9, token_threshold=0.4
  ),
  "mbpp": ReFusion(PAPER_GEN_LENGTH, slot_size=32, serial_blocks=4, slot_threshold=0.9, token_threshold=0.3),
  "arc_challenge_chat": ReFusion(
    PAPER_GEN_LENGTH, slot_size=8, serial_blocks=64, slot_threshold=0.8, token_threshold=0.1
  ),
  "mmlu_pro": ReFusion(PAPER_GEN_LENGTH, slot_size=16, serial_blocks=4, slot_threshold=0.9, token_threshold=0.4),
  "gpqa_main_generative_n_shot": ReFusion(
    PAPER_GEN_LENGTH, slot_size=8, serial_blocks=32, slot_threshold=0.8, token_threshold=0.2
  ),
}


def paper_method(task: str, **overrides: Any) -> ReFusion:
  """The paper's settings for `task` with `overrides` (ReFusion's fields; None counts as unset): a `gen_length`
  first resizes the method (`ReFusion.resized`: serial blocks fitted to a shorter answer unless given), then the
  other fields replace the paper's.

      paper_method("gsm8k_cot", gen_length=64)   # S = 32, NB = 2, the thresholds of gsm8k_cot
  """
  if task not in PAPER_TASKS:
    raise ValueError(f"paper task {task!r} is not one of the paper's tasks: {', '.join(PAPER_TASKS)}.")
  given = {name: value for name, value in overrides.items() if value is not None}
  fields = {field.name for field in dataclasses.fields(ReFusion)}
  unknown = sorted(set(given) - fields)
  if unknown:
    raise ValueError(
      f"{', '.join(unknown)}: not ReFusion's fields ({', '.join(sorted(fields))}); a paper task sets ReFusion."
    )
  method = PAPER_TASKS[task]
  if "gen_length" in given:
    method = method.resized(given.pop("gen_length"))
  return dataclasses.replace(method, **given)
