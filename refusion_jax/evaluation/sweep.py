"""The decode settings an evaluation sweeps, as method values, and the result record of each.

A command line names a method and gives any of its fields one or more
values; a field it leaves unset takes the training config's evaluation value
(`methods.config_method`'s keys), else the method's default. Every
combination is one method value, evaluated and written as one record.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from refusion_jax.decoding.contract import Method
from refusion_jax.decoding.mdm import MDM
from refusion_jax.decoding.methods import method_class, method_value
from refusion_jax.decoding.refusion import ReFusion
from refusion_jax.evaluation import runner


def method_sweep(
  name: str, values: Mapping[str, Sequence[Any] | None], section: ml_collections.ConfigDict
) -> list[Method]:
  """Every combination of method `name`'s field values: `values[field]` where given, else the config section's
  (`<name>_<field>`, then `<field>`), else the method's default.

  The config's MDM block and steps are cut to a shorter `gen_length` given on the command line.
  """
  grid = {}
  for field in dataclasses.fields(method_class(name)):
    given = values.get(field.name)
    if given is None:
      given = section.get(f"{name}_{field.name}", section.get(field.name))
    if given is not None:
      grid[field.name] = list(given) if isinstance(given, (list, tuple)) else [given]
  combinations = [dict(zip(grid, combination)) for combination in itertools.product(*grid.values())]
  if name == MDM.name:
    for fields in combinations:
      for field in ("block_length", "steps"):
        if fields.get(field) is not None and values.get(field) is None:
          fields[field] = min(fields[field], fields["gen_length"])
  return [method_value(name, fields) for fields in combinations]


def default_label(method: Method) -> str:
  """A short name for reports, e.g. `refusion S8 0.9/0.5` or `mdm B16 24 steps`."""
  if isinstance(method, ReFusion):
    return f"refusion S{method.slot_size} {method.slot_threshold:g}/{method.token_threshold:g}"
  if isinstance(method, MDM):
    return f"mdm B{method.block_length} {method.steps} steps"
  return method.name


def result_record(run: runner.EvalRun, method: Method, **about: Any) -> dict:
  """The JSON record of one evaluation: `about` (model, label, checkpoint, data, ...), the method and its fields
  (under "knobs", the key result files have always used), the metrics and every answer."""
  return dict(
    about,
    method=method.name,
    knobs=dataclasses.asdict(method),
    metrics=runner.summarize(run),
    answers=[vars(answer) for answer in run.answers],
  )
