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
from refusion_jax.decoding.methods import method_class, method_value
from refusion_jax.evaluation import runner


def method_sweep(
  name: str, values: Mapping[str, Sequence[Any] | None], section: ml_collections.ConfigDict
) -> list[Method]:
  """Every combination of method `name`'s field values: `values[field]` where given, else the config section's
  (`<name>_<field>`, then `<field>`), else the method's default.

  The config's settings are moved to a `gen_length` given on the command line by the method itself
  (`Method.resized`: e.g. MDM's block and steps cut to a shorter answer), then the other given values set.
  """
  grid, configured = {}, {}
  for field in dataclasses.fields(method_class(name)):
    given = values.get(field.name)
    if given is not None:
      grid[field.name] = list(given) if isinstance(given, (list, tuple)) else [given]
    else:
      configured[field.name] = section.get(f"{name}_{field.name}", section.get(field.name))
  methods = []
  for combination in itertools.product(*grid.values()):
    given = dict(zip(grid, combination))
    method = method_value(name, configured)
    if "gen_length" in given:
      method = method.resized(given.pop("gen_length"))
    methods.append(dataclasses.replace(method, **given))
  return methods


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
