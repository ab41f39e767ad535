"""refusion_jax/parallel/mesh_spec.py: the one mesh syntax every command reads (`fsdp:4+tensor:2`)."""

import ast
import pathlib

import numpy as np
import pytest

import refusion_jax
from refusion_jax.parallel.mesh_spec import format_mesh_spec, parse_mesh_spec
from refusion_jax.parallel.sharding import MESH_AXES


def test_a_printed_mesh_reads_back_as_the_same_shape():
  rng = np.random.default_rng()
  for _ in range(50):
    shape = {axis: int(rng.choice([1, 2, 3, 4, 8, 16])) for axis in MESH_AXES if rng.random() < 0.7}
    if not any(size > 1 for size in shape.values()):
      continue
    read = parse_mesh_spec(format_mesh_spec(shape))
    assert read == {axis: size for axis, size in shape.items() if size > 1}, shape


def test_one_axis_may_take_every_remaining_device():
  assert parse_mesh_spec("data:-1") == {"data": -1}
  assert parse_mesh_spec(" fsdp:-1+tensor:2 ") == {"fsdp": -1, "tensor": 2}


@pytest.mark.parametrize(
  "spec, message",
  [
    ("rows:2", "mesh 'rows:2' names no mesh axis (the axes are data, fsdp, tensor)"),
    ("data:2+data:4", "data:4 names data a second time"),
    ("data:0", "neither a positive whole number nor -1"),
    ("tensor:two", "neither a positive whole number nor -1"),
    ("data2", "is not an axis:size pair"),
    ("data=2,tensor=4", "'data=2,tensor=4' is not an axis:size pair"),  # 0.2's aot spelling, removed in 0.3
    ("data:-1+fsdp:-1", "at most one axis may be -1"),
  ],
)
def test_a_bad_spec_is_refused_naming_the_part_and_showing_the_syntax(spec, message):
  with pytest.raises(ValueError, match="write axis:size pairs joined by|e.g. data:-1") as error:
    parse_mesh_spec(spec)
  assert message in str(error.value)


@pytest.mark.extra("eval")
def test_the_harness_reports_a_bad_mesh_as_a_model_argument_error():
  from refusion_jax.evaluation import harness

  with pytest.raises(harness.HarnessArgumentError, match="mesh 'fsdp:4\\+gpu:2': gpu:2 names no mesh axis"):
    harness.build_mesh("fsdp:4+gpu:2")


def test_no_other_module_parses_a_mesh_spec():
  """Every command reads a mesh through parse_mesh_spec: no second parser comes back."""
  root = pathlib.Path(refusion_jax.__file__).parent
  parsers = [
    f"{path.relative_to(root)}:{node.name}"
    for path in root.rglob("*.py")
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
    if isinstance(node, ast.FunctionDef) and "mesh" in node.name and "parse" in node.name
  ]
  assert parsers == ["parallel/mesh_spec.py:parse_mesh_spec"], parsers
