"""Every parameter's PartitionSpec under the default rules, against a committed golden file.

A change to a logical axis name, to the rules table or to the parameter tree
changes how checkpoints and pods lay parameters out; this test makes such a
change a deliberate one. After an intended change, regenerate the file:

    REFUSION_REGENERATE_GOLDEN=1 python -m pytest -q tests/test_partition_specs.py
"""

import json
import os

import jax
from flax import nnx

from refusion_jax.model.config import tiny
from refusion_jax.model.transformer import init_model
from refusion_jax.parallel import sharding

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "partition_specs_tiny.json")
# Qwen3 (q/k norm, untied head) and Qwen2 (q/k/v biases, tied embeddings) cover every parameter kind.
CONFIGS = {
  "qwen3": tiny(),
  "qwen2_tied": tiny(architecture="qwen2", tie_embeddings=True),
}


def partition_specs(config) -> dict[str, list]:
  """{"layers/0/self_attn/q_proj": ["fsdp", "tensor", null], ...} under the default rules."""
  abstract = nnx.state(nnx.eval_shape(lambda: init_model(config)))
  mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])  # specs do not depend on the axis sizes
  shardings = sharding.state_shardings(abstract, mesh)
  return {
    "/".join(str(part) for part in path): [list(a) if isinstance(a, tuple) else a for a in var.get_value().spec]
    for path, var in nnx.to_flat_state(shardings)
  }


def golden_text(specs: dict[str, dict[str, list]]) -> str:
  """JSON with one parameter per line, so that a diff of the file names the parameters that changed."""
  blocks = []
  for name in sorted(specs):
    lines = [f"    {json.dumps(path)}: {json.dumps(spec)}" for path, spec in sorted(specs[name].items())]
    blocks.append(f"  {json.dumps(name)}: {{\n" + ",\n".join(lines) + "\n  }")
  return "{\n" + ",\n".join(blocks) + "\n}\n"


def test_partition_specs_match_the_golden_file():
  specs = {name: partition_specs(config) for name, config in CONFIGS.items()}
  if os.environ.get("REFUSION_REGENERATE_GOLDEN"):
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    with open(GOLDEN, "w", encoding="utf-8") as f:
      f.write(golden_text(specs))
  with open(GOLDEN, encoding="utf-8") as f:
    golden = json.load(f)
  for name in CONFIGS:
    changed = {
      path: (golden[name].get(path), spec) for path, spec in specs[name].items() if golden[name].get(path) != spec
    }
    missing = sorted(set(golden[name]) - set(specs[name]))
    assert not changed and not missing, (
      f"{name}: PartitionSpecs changed (path: (golden, now)) {changed}; gone: {missing}. If intended, regenerate "
      "with REFUSION_REGENERATE_GOLDEN=1 (see this module's docstring)."
    )
