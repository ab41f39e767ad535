"""The decode knobs' defaults, in one place: the Sampler, the sample CLI and the bench read them here.

The paper's settings scaled to short CPU demos. MDM follows LLaDA's usual
setting: one token per step (steps = G) in blocks of 32 (the whole answer
when it is shorter).
"""

from __future__ import annotations

import warnings

GEN_LENGTH = 64
# ReFusion (docs/method.md §2): slot size S, serial blocks NB and the two thresholds.
REFUSION_KNOBS = dict(slot_size=4, serial_blocks=1, slot_threshold=0.9, token_threshold=0.9)
MDM_BLOCK_LENGTH = 32


def mdm_block_length(gen_length: int) -> int:
  """MDM tokens per block: 32, or the whole answer when G is shorter."""
  return min(MDM_BLOCK_LENGTH, gen_length)


def mdm_steps(gen_length: int) -> int:
  """MDM unmasking steps in all: one token per step."""
  return gen_length


def method_defaults(method: str, gen_length: int = GEN_LENGTH) -> dict:
  """Every knob a method's decoder needs that has a default, for an answer of `gen_length` tokens."""
  if method == "refusion":
    return dict(gen_length=gen_length, **REFUSION_KNOBS)
  if method == "mdm":
    return dict(gen_length=gen_length, block_length=mdm_block_length(gen_length), steps=mdm_steps(gen_length))
  return dict(gen_length=gen_length)


def __getattr__(name: str):
  if name == "REFUSION":
    warnings.warn(
      "refusion_jax.decoding.defaults.REFUSION is renamed REFUSION_KNOBS (refusion.REFUSION is the decoding "
      "Method); REFUSION will be removed.",
      DeprecationWarning,
      stacklevel=2,
    )
    return REFUSION_KNOBS
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
