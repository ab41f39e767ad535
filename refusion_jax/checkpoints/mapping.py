"""Stored-array name tables: which stored array becomes which of our parameters, and what its axes mean.

Every checkpoint format we read is described by one `Table` of `Rule`s. A rule
names a stored array (a template such as `layers.{layer}.attn.q_proj.w.value`),
the parameter it fills (`layers.{layer}.self_attn.q_proj`), the meaning of
each stored axis (`("embed", "heads", "head_dim")`, or `"heads*head_dim"` for
two axes fused into one) and how to turn it into our layout.

The axis names make three things generic across formats:

- the model fields a checkpoint determines (`infer_fields`: vocabulary,
  widths, layers, heads, KV heads, head dim, q/k norms, biases, tied head);
- the check of every stored shape against a config, naming the field that
  disagrees (`expected_shape`, `misfit_fields`);
- the sharding of a stored array that is not in our layout yet (it is
  placed by the same logical-axis rules as the parameter it becomes).

Axis names are the model's logical axes (`refusion_jax.model.transformer`),
plus `layers` (a scanned stack of layers) and `padded_vocab` (a vocabulary
rounded up, as MaxText stores it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from refusion_jax.model.config import ModelConfig
from refusion_jax.model.quant import GROUPS_AXIS

# Axes that keep their stored size (a padded vocabulary; the input groups of a quantized kernel's scales, which
# the stored config's quantize_group_size sets) and determine no field.
_STORED_SIZE_AXES = ("padded_vocab", GROUPS_AXIS)

# Logical axis -> the ModelConfig field that sizes it.
AXIS_FIELDS = {
  "vocab": "vocab_size",
  "padded_vocab": "vocab_size",
  "embed": "hidden_size",
  "mlp": "intermediate_size",
  "heads": "num_heads",
  "kv_heads": "num_kv_heads",
  "head_dim": "head_dim",
  "layers": "num_layers",
}

# The fields stored arrays determine (and a config must agree with).
ARRAY_FIELDS = (
  "vocab_size",
  "hidden_size",
  "intermediate_size",
  "num_layers",
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "qk_norm",
  "qkv_bias",
  "tie_embeddings",
)

# What each {placeholder} in a template may stand for.
_PLACEHOLDERS = {"layer": r"\d+", "qkv": "q|k|v", "kv": "k|v", "qk": "q|k", "gate_up": "gate|up"}

# Our parameters that only some configs have, and the switch that decides it.
_OPTIONAL = (
  (re.compile(r"self_attn\.(q|k)_norm\."), "qk_norm"),
  (re.compile(r"self_attn\.(q|k|v)_bias$"), "qkv_bias"),
  (re.compile(r"^lm_head$"), "tie_embeddings"),
)

# A layout conversion: (stored array, our shape) -> our array. Works on numpy and jax arrays alike.
Convert = Callable[[Any, tuple[int, ...]], Any]


def split_heads(x, shape):
  """Biases stored flat, [heads * head_dim] -> [heads, head_dim]."""
  return x.reshape(shape)


@functools.cache
def _template_regex(template: str) -> re.Pattern:
  parts = re.split(r"\{(\w+)\}", template)
  # Even entries are literal text, odd entries placeholder names.
  pattern = "".join(
    re.escape(part) if i % 2 == 0 else f"(?P<{part}>{_PLACEHOLDERS[part]})" for i, part in enumerate(parts)
  )
  return re.compile(pattern)


@dataclasses.dataclass(frozen=True)
class Rule:
  """One stored array (template) -> one of our parameters (template).

  `stored_axes` names each stored axis; "a*b" is two logical axes fused into
  one. A stored template without `{layer}` whose ours has one is a scanned
  stack: its `layers` axis holds every layer. `to_ours` is None when the
  stored layout already is ours (the array is restored straight into place).
  """

  stored: str
  ours: str
  stored_axes: tuple[str, ...]
  to_ours: Convert | None = None

  @property
  def stacked(self) -> bool:
    return "{layer}" in self.ours and "{layer}" not in self.stored

  def match(self, name: str, to_stored: bool = False) -> dict[str, str] | None:
    """The placeholder values when `name` (stored, or ours with `to_stored`) fits this rule."""
    match = _template_regex(self.ours if to_stored else self.stored).fullmatch(name)
    return None if match is None else match.groupdict()


@dataclasses.dataclass(frozen=True)
class Entry:
  """A stored array matched to a rule: which of our parameters it fills (one, or one per layer when stacked)."""

  name: str
  shape: tuple[int, ...]
  dtype: Any
  rule: Rule
  ours: tuple[str, ...]


class Table:
  """The rules of one format, tried in order."""

  def __init__(self, rules: Iterable[Rule]):
    self.rules = tuple(rules)

  def rule_for(self, name: str) -> tuple[Rule, dict[str, str]] | None:
    for rule in self.rules:
      groups = rule.match(name)
      if groups is not None:
        return rule, groups
    return None

  def stored(self, ours: str, prefer: Iterable[Rule] = ()) -> tuple[str, Rule] | None:
    """The stored name (the stack's name for a scanned layer) and rule that fill our parameter `ours`.

    Rules in `prefer` (those a checkpoint uses, e.g. its unscanned spelling) are tried first.
    """
    prefer = [rule for rule in self.rules if rule in set(prefer)]
    for rule in prefer + [rule for rule in self.rules if rule not in prefer]:
      groups = rule.match(ours, to_stored=True)
      if groups is not None:
        return rule.stored.format(**groups), rule
    return None

  def stored_name(self, ours: str, prefer: Iterable[Rule] = ()) -> str | None:
    found = self.stored(ours, prefer)
    return None if found is None else found[0]

  def entries(self, arrays: Mapping[str, tuple[tuple[int, ...], Any]]) -> tuple[list[Entry], list[str]]:
    """Match stored arrays ({name: (shape, dtype)}) to rules; returns (entries, names no rule knows)."""
    entries, unknown = [], []
    for name, (shape, dtype) in arrays.items():
      found = self.rule_for(name)
      if found is None:
        unknown.append(name)
        continue
      rule, groups = found
      if rule.stacked:
        layers = shape[rule.stored_axes.index("layers")] if len(shape) == len(rule.stored_axes) else 0
        ours = tuple(rule.ours.format(layer=i, **groups) for i in range(layers))
      else:
        ours = (rule.ours.format(**groups),)
      entries.append(Entry(name, tuple(shape), dtype, rule, ours))
    return entries, unknown


def axis_size(axis: str, config: ModelConfig) -> int:
  """The size a (possibly fused "a*b") stored axis has under `config`."""
  return math.prod(getattr(config, AXIS_FIELDS[part]) for part in axis.split("*"))


def expected_shape(entry: Entry, config: ModelConfig) -> tuple[int, ...]:
  """The shape `entry` must have under `config` (a padded vocabulary keeps its stored size)."""
  return tuple(
    stored if axis in _STORED_SIZE_AXES else axis_size(axis, config)
    for axis, stored in zip(entry.rule.stored_axes, entry.shape)
  )


def misfit_fields(entry: Entry, config: ModelConfig) -> str:
  """Which config fields the stored shape of `entry` contradicts, e.g. "num_kv_heads × head_dim = 16, the
  array says 8"."""
  if len(entry.shape) != len(entry.rule.stored_axes):
    return f"expected {len(entry.rule.stored_axes)} axes ({', '.join(entry.rule.stored_axes)})"
  parts = []
  for axis, size in zip(entry.rule.stored_axes, entry.shape):
    if axis == GROUPS_AXIS:
      continue
    if axis == "padded_vocab":
      if size < config.vocab_size:
        parts.append(f"vocab_size = {config.vocab_size} exceeds the stored (padded) vocabulary {size}")
      continue
    want = axis_size(axis, config)
    if size != want:
      fields = " × ".join(AXIS_FIELDS[part] for part in axis.split("*"))
      parts.append(f"{fields} = {want} in the config, the array says {size}")
  return "; ".join(parts)


def infer_fields(entries: Iterable[Entry], layer_count: int | None = None) -> dict[str, Any]:
  """The `ModelConfig` fields the stored arrays determine (see `ARRAY_FIELDS`).

  Fused axes ("heads*head_dim") determine nothing alone; a padded vocabulary
  only bounds `vocab_size`, so it is reported as `padded_vocab`.

  Raises:
    ValueError: two arrays disagree on an axis, naming both.
  """
  entries = list(entries)
  seen: dict[str, tuple[int, str]] = {}
  for entry in entries:
    for axis, size in zip(entry.rule.stored_axes, entry.shape):
      if "*" in axis or axis == GROUPS_AXIS:
        continue
      if axis in seen and seen[axis][0] != size:
        raise ValueError(
          f"The checkpoint is inconsistent: {entry.name} has {AXIS_FIELDS[axis]} = {size} (axis {axis!r}) but "
          f"{seen[axis][1]} has {seen[axis][0]}."
        )
      seen.setdefault(axis, (size, entry.name))
  _derive_fused(entries, seen)
  fields = {AXIS_FIELDS[axis]: size for axis, (size, _) in seen.items() if axis not in ("padded_vocab", "layers")}
  if "padded_vocab" in seen:
    fields["padded_vocab"] = seen["padded_vocab"][0]
  layers = {int(g) for e in entries for path in e.ours for g in re.findall(r"^layers\.(\d+)\.", path)}
  if layers:
    fields["num_layers"] = max(layers) + 1
  ours = {path for entry in entries for path in entry.ours}
  for pattern, flag in _OPTIONAL:
    present = any(pattern.search(path) for path in ours)
    fields[flag] = not present if flag == "tie_embeddings" else present
  order = [("padded_vocab" if f == "vocab_size" and "padded_vocab" in fields else f) for f in ARRAY_FIELDS]
  return {field: fields[field] for field in order if field in fields}


def _derive_fused(entries: list[Entry], seen: dict[str, tuple[int, str]]) -> None:
  """Fill in the one unknown part of a fused axis ("heads*head_dim" with head_dim known from a q_norm)."""
  for entry in entries:
    for axis, size in zip(entry.rule.stored_axes, entry.shape):
      parts = axis.split("*")
      unknown = [part for part in parts if part not in seen]
      if len(parts) > 1 and len(unknown) == 1:
        known = math.prod(seen[part][0] for part in parts if part in seen)
        if size % known == 0:
          seen[unknown[0]] = (size // known, entry.name)


def disagreements(config: ModelConfig, fields: Mapping[str, Any]) -> list[str]:
  """ "field: config X, checkpoint Y" for every array-determined field `config` contradicts."""
  out = []
  for field, value in fields.items():
    if field == "padded_vocab":
      if config.vocab_size > value:
        out.append(f"vocab_size: the config has {config.vocab_size}, the checkpoint stores {value} rows")
    elif getattr(config, field) != value:
      out.append(f"{field}: the config has {getattr(config, field)}, the checkpoint's arrays say {value}")
  return out


def optional_switch(path: str) -> str | None:
  """The config switch (`qk_norm`, `qkv_bias`, `tie_embeddings`) that decides whether our `path` exists."""
  return next((flag for pattern, flag in _OPTIONAL if pattern.search(path)), None)


def summary(config: ModelConfig) -> str:
  c = config
  return (
    f"{c.architecture}, vocab {c.vocab_size}, hidden {c.hidden_size}, mlp {c.intermediate_size}, "
    f"{c.num_layers} layers, {c.num_heads} heads / {c.num_kv_heads} kv heads of {c.head_dim}, "
    f"tied embeddings {c.tie_embeddings}"
  )


def check_fit(
  entries: Sequence[Entry],
  unknown: Sequence[str],
  table: Table,
  config: ModelConfig,
  targets: Mapping[str, tuple[int, ...]],
  where: Callable[[str], str] = lambda name: "",
) -> None:
  """Refuse, naming the stored array, anything that does not fill `targets` ({our path: shape}) exactly.

  Args:
    where: a prefix locating a stored array (e.g. its file) in messages.

  Raises:
    ValueError: an array no rule knows, one the config has no place for (naming the
      switch that would make room), a shape the config contradicts (naming the
      fields), an array given twice, or a parameter no array fills.
  """
  misfit = f"the checkpoint does not fit the config ({summary(config)})"
  if unknown:
    raise ValueError(f"{where(unknown[0])}tensor {unknown[0]} has no counterpart in the model; {misfit}.")
  filled: dict[str, str] = {}
  for entry in entries:
    for path in entry.ours:
      if path not in targets:
        switch = optional_switch(path)
        reason = f" ({switch}={getattr(config, switch)})" if switch else ""
        raise ValueError(
          f"{where(entry.name)}tensor {entry.name} (our {path}) is not part of this config{reason}; {misfit}."
        )
      if path in filled:
        raise ValueError(f"{where(entry.name)}tensor {entry.name} fills our {path}, which {filled[path]} fills too.")
      filled[path] = entry.name
    want = expected_shape(entry, config)
    if entry.shape != want:
      raise ValueError(
        f"{where(entry.name)}tensor {entry.name} has shape {entry.shape}, expected {want} "
        f"({misfit_fields(entry, config)}); {misfit}."
      )
  missing = sorted(set(targets) - set(filled))
  if missing:
    used = {entry.rule for entry in entries}
    names = [f"{table.stored_name(path, used)} (our {path})" for path in missing]
    switches = {optional_switch(path) for path in missing}
    switch = switches.pop() if len(switches) == 1 else None
    reason = f" ({switch}={getattr(config, switch)})" if switch else ""
    raise ValueError(f"The checkpoint lacks {len(missing)} tensors{reason}: {names}; {misfit}.")
