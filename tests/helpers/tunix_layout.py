"""Write one of our models in the tree tunix's checkpoint manager writes, without tunix (CI cannot import it).

`<root>/<step>/model_params`, an orbax PyTree (OCDBT) of `nnx.state(model)` under tunix's names
(`refusion_jax.checkpoints.tunix.TABLE`; Qwen2 biases flat). tests/fixtures/tunix holds checkpoints tunix
itself wrote, which the same loader reads: this writer is for sizes and runs the fixtures do not cover.
"""

from __future__ import annotations

import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from refusion_jax.checkpoints.restore import dotted
from refusion_jax.checkpoints.tunix import ITEM, TABLE


def save_tunix_layout(model: nnx.Module, root: str, step: int = 1) -> None:
  tree: dict = {}
  for path, variable in nnx.to_flat_state(nnx.state(model)):
    name, rule = TABLE.stored(dotted(path))
    value = np.asarray(variable.get_value())
    *parents, leaf = name.split(".")
    node = tree
    for key in parents:
      node = node.setdefault(key, {})
    node[leaf] = value.reshape(-1) if "*" in "".join(rule.stored_axes) else value
  with ocp.CheckpointManager(root, item_names=(ITEM,)) as manager:
    manager.save(step, args=ocp.args.Composite(**{ITEM: ocp.args.PyTreeSave(tree)}))
    manager.wait_until_finished()
