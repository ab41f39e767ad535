"""The paper's decoding settings per lm-eval task (the official eval.sh), as `ReFusion` values.

Every task decodes G = 512 tokens, zero-shot, with the chat template; the
harness (`refusion_jax.evaluation.harness`, `paper_task=`) shortens G per
request and keeps the rest.
"""

from __future__ import annotations

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
