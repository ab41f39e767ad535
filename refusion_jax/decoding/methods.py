"""The decoding methods by name, and a method value from named values (command-line flags, a config section).

Command lines, configs and the lm-eval harness name a method ("refusion",
"ar", "mdm"); `METHODS` maps the name to its class (a new method joins with
`register_method`, from its own file), and `method_value` builds
the value from whatever values are given for the class's fields, generically:
a flag or key spelt like a field sets it, everything else is left to the
class's defaults (`config_method`: a config's `<method>_<field>` key, e.g.
`mdm_steps`, wins over its shared `<field>` key). So a field added to a method is a flag of every command
(`add_method_flags`) without another list to keep.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from refusion_jax.decoding.ar import AR
from refusion_jax.decoding.contract import Method
from refusion_jax.decoding.mdm import MDM
from refusion_jax.decoding.refusion import ReFusion

METHODS: dict[str, type[Method]] = {cls.name: cls for cls in (ReFusion, AR, MDM)}

# What the loop and the rest of the package ask of a method class (`contract.Method`).
_CONTRACT = ("name", "width_names", "start_rows", "admit", "step", "decoder", "label", "answer_grid", "token_grid")
_CONTRACT += ("resized", "official_tpf")


def register_method(cls: type[Method]) -> type[Method]:
  """Make a method class known by its `name` to every command line, config section, the evaluation, the lm-eval
  harness and the server (a class decorator; `rj.decode`, `Sampler` and `Engine` take any method value without
  it). Its fields become flags of every command built afterwards (`add_method_flags`).

  Raises:
    ValueError: the class is not a frozen dataclass with the contract's parts, or another class has its name.
  """
  missing = [part for part in _CONTRACT if not hasattr(cls, part)]
  params = getattr(cls, "__dataclass_params__", None)
  if missing or params is None or not params.frozen:
    problem = f"lacks {', '.join(missing)}" if missing else "is not a frozen dataclass"
    raise ValueError(
      f"{cls.__name__} {problem}: a method is a frozen dataclass implementing refusion_jax.decoding.contract.Method "
      "(inherit contract.MethodFacts for the defaults of label, answer_grid, token_grid, resized and official_tpf)."
    )
  if METHODS.get(cls.name, cls) is not cls:
    raise ValueError(f"A method named {cls.name!r} is registered already ({METHODS[cls.name].__qualname__}).")
  METHODS[cls.name] = cls
  return cls


def method_class(name: str) -> type[Method]:
  """The class of the method called `name`."""
  if name not in METHODS:
    raise ValueError(f"Unknown method {name!r}; choose one of {', '.join(METHODS)}.")
  return METHODS[name]


def method_value(name: str, values: Mapping[str, Any]) -> Method:
  """Method `name` built from `values`: its fields found there (None counts as unset), the rest its defaults."""
  cls = method_class(name)
  return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if values.get(f.name) is not None})


def config_method(name: str, section: Mapping[str, Any]) -> Method:
  """Method `name` from a config section (`config.eval`): each field from the method's own key
  `<name>_<field>` (e.g. `mdm_steps`) where the section has one, else from the shared key `<field>`."""
  fields = [f.name for f in dataclasses.fields(method_class(name))]
  return method_value(name, {f: section.get(f"{name}_{f}", section.get(f)) for f in fields})


def field_names(name: str) -> list[str]:
  """The fields of method `name` (what its flags and config keys are spelt as)."""
  return [f.name for f in dataclasses.fields(method_class(name))]


def field_type(cls: type, name: str) -> Callable[[str], Any]:
  """How a command line converts the text of field `name` of method class `cls` (int, float or bool)."""
  hint = typing.get_type_hints(cls)[name]
  kinds = [t for t in typing.get_args(hint) if t is not type(None)] if isinstance(hint, types.UnionType) else [hint]
  return _parse_bool if kinds[0] is bool else kinds[0]


def _parse_bool(text: str) -> bool:
  if text.lower() in ("1", "true", "yes"):
    return True
  if text.lower() in ("0", "false", "no"):
    return False
  raise argparse.ArgumentTypeError(f"{text!r} is not a boolean; write true or false.")


def add_method_flags(
  group: argparse._ActionsContainer, values: Callable[[Callable[[str], Any]], Callable[[str], Any]] | None = None
) -> None:
  """`--method` and one flag per field of every method (default None: unset, the method's default).

  `values` wraps each field's converter (e.g. into a comma-separated sweep of values).
  """
  group.add_argument("--method", choices=list(METHODS), default="refusion")
  seen: dict[str, list[str]] = {}
  for cls in METHODS.values():
    for field in dataclasses.fields(cls):
      seen.setdefault(field.name, []).append(cls.name)
  for name, owners in seen.items():
    cls = METHODS[owners[0]]
    kind = field_type(cls, name)
    defaults = ", ".join(f"{owner} {_default_text(METHODS[owner], name)}" for owner in owners)
    group.add_argument(f"--{name}", type=values(kind) if values else kind, help=f"default: {defaults}.")


def _default_text(cls: type, name: str) -> str:
  field = next(f for f in dataclasses.fields(cls) if f.name == name)
  return "follows gen_length" if field.default is None else repr(field.default)


def flag_values(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
  """The set flags among `names` (`add_method_flags`' flags left unset are None)."""
  return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
