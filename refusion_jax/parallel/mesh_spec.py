"""The one way a command line names a device mesh: `axis:size` pairs joined by `+`.

    data:-1              every device on the data axis
    fsdp:4+tensor:2      8 devices: parameters sharded 4 ways, heads / MLP / vocab 2 ways

The axes are `sharding.MESH_AXES` (`data`, `fsdp`, `tensor`); an axis left out
has size 1 and one axis may be -1, "every remaining device". The same text
works wherever a mesh is asked for: `python -m refusion_jax.aot --decode_mesh`,
the lm-eval harness's `--model_args mesh=...` (whose own syntax splits on `,`
and `=`, which is why neither appears here), and `format_mesh_spec` prints a
mesh back in it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from refusion_jax.parallel.sharding import MESH_AXES

_SIZE = re.compile(r"-1|[1-9]\d*")
_EXAMPLES = "e.g. data:-1 or fsdp:4+tensor:2"


def parse_mesh_spec(spec: str) -> dict[str, int]:
  """ "fsdp:4+tensor:2" -> {"fsdp": 4, "tensor": 2}: the mesh shape `sharding.make_mesh` takes.

  Raises:
    ValueError: naming the part that is wrong and showing the syntax.
  """
  pairs = [part.partition(":") for part in spec.strip().split("+")]
  shape: dict[str, int] = {}
  for name, colon, size in pairs:
    name, size = name.strip(), size.strip()
    problem = _problem(name, colon, size, shape)
    if problem:
      pair = f": {name}{colon}{size}" if len(pairs) > 1 else ""
      raise ValueError(f"mesh {spec!r}{pair} {problem}; write axis:size pairs joined by '+', {_EXAMPLES}.")
    shape[name] = int(size)
  if list(shape.values()).count(-1) > 1:
    raise ValueError(f"mesh {spec!r}: at most one axis may be -1 (every remaining device), {_EXAMPLES}.")
  return shape


def _problem(name: str, separator: str, size: str, seen: Mapping[str, int]) -> str:
  """What is wrong with one pair of a spec ("" when nothing is)."""
  if not separator:
    return "is not an axis:size pair"
  if name not in MESH_AXES:
    return f"names no mesh axis (the axes are {', '.join(MESH_AXES)})"
  if name in seen:
    return f"names {name} a second time"
  if not _SIZE.fullmatch(size):
    return "has a size that is neither a positive whole number nor -1"
  return ""


def format_mesh_spec(shape: Mapping[str, int]) -> str:
  """{"data": 2, "fsdp": 1, "tensor": 4} -> "data:2+tensor:4": the axes of more than one device, in mesh order
  ("" when there are none), as `parse_mesh_spec` reads them back."""
  return "+".join(f"{name}:{shape[name]}" for name in MESH_AXES if shape.get(name, 1) != 1)
