"""Deprecated: the decode knobs' defaults live on the method classes now (`rj.ReFusion()`, `rj.AR()`, `rj.MDM()`).

Every old name keeps working until `deprecation.REMOVED_IN`, with a warning that names its replacement.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from refusion_jax.decoding import mdm
from refusion_jax.decoding.methods import method_value
from refusion_jax.decoding.refusion import ReFusion
from refusion_jax.deprecation import moved_names


def _refusion_knobs() -> dict[str, Any]:
  method = ReFusion()
  return {name: getattr(method, name) for name in ("slot_size", "serial_blocks", "slot_threshold", "token_threshold")}


def _method_defaults(method: str, gen_length: int = ReFusion.gen_length) -> dict[str, Any]:
  """The 0.2 `method_defaults`: a method's fields with a default, for an answer of `gen_length` tokens."""
  value = dataclasses.asdict(method_value(method, dict(gen_length=gen_length)))
  value.pop("temperature")
  value.pop("fit_width", None)
  return value


__getattr__ = moved_names(
  __name__,
  {
    "GEN_LENGTH": (
      "refusion_jax.ReFusion().gen_length (each method class holds its defaults)",
      lambda: ReFusion().gen_length,
    ),
    "REFUSION_KNOBS": ("the fields of refusion_jax.ReFusion()", _refusion_knobs),
    "REFUSION": ("the fields of refusion_jax.ReFusion()", _refusion_knobs),
    "MDM_BLOCK_LENGTH": ("refusion_jax.decoding.mdm.MDM_BLOCK_LENGTH", lambda: mdm.MDM_BLOCK_LENGTH),
    "mdm_block_length": (
      "refusion_jax.MDM(gen_length=G).block_length",
      lambda: lambda gen_length: min(mdm.MDM_BLOCK_LENGTH, gen_length),
    ),
    "mdm_steps": ("refusion_jax.MDM(gen_length=G).steps", lambda: lambda gen_length: gen_length),
    "method_defaults": (
      "dataclasses.asdict(refusion_jax.decoding.methods.method_value(name, ...))",
      lambda: _method_defaults,
    ),
  },
)
