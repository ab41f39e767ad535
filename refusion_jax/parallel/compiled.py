"""Ahead-of-time compilation reports: per-device memory, compiled cost and a roofline estimate (docs/method.md §5).

A jitted function lowered with abstract arguments (`jax.ShapeDtypeStruct`s
carrying `NamedSharding`s) compiles for whatever devices the mesh holds: the
local ones, fake CPU devices, or the devices of a TPU topology that libtpu
describes from a machine without a TPU (`topology_devices("v5p:4x4x4")`). The
compiled program then states what each device will hold, which is how a pod
configuration is checked before a pod is rented.

`compile_report` turns one such compile into a `Report`; a compile the
compiler itself rejects for lack of memory becomes a report that does not fit
(with the compiler's own numbers when its message has them). XLA's cost
analysis counts a loop body once, so a program whose layers are scanned is
also counted from its trace (`matmul_flops`), every loop at its trip count.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from refusion_jax.model import quant

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
  """What one device offers; spec-sheet peak numbers except where the compiler states its own limit."""

  name: str
  hbm_bytes: float
  peak_flops: float  # bf16 dense FLOP/s
  hbm_bandwidth: float  # bytes/s


# By `device.device_kind`. v5p's HBM is the limit the compiler reports for it (95.74 GiB), not the 95 GB on the sheet.
CHIPS = {
  "TPU v4": Chip("TPU v4", 32 * GIB, 275e12, 1.2e12),
  "TPU v5": Chip("TPU v5p", 95.74 * GIB, 459e12, 2.765e12),
  "TPU v5 lite": Chip("TPU v5e", 16 * GIB, 197e12, 8.19e11),
  "TPU v6 lite": Chip("TPU v6e", 32 * GIB, 918e12, 1.64e12),
}
# GPUs by a name their `device_kind` contains ("NVIDIA H100 80GB HBM3"), most specific first: the PCIe and NVL
# H100s are slower than the SXM one. Dense bf16 peaks (the sheets' sparse numbers halved).
GPU_CHIPS = {
  "H100 PCIe": Chip("NVIDIA H100 PCIe", 80e9, 756e12, 2.0e12),
  "H100 NVL": Chip("NVIDIA H100 NVL", 94e9, 835e12, 3.9e12),
  "H100": Chip("NVIDIA H100 SXM", 80e9, 989e12, 3.35e12),
  "H200": Chip("NVIDIA H200", 141e9, 989e12, 4.8e12),
  "A100": Chip("NVIDIA A100 80GB", 80e9, 312e12, 2.04e12),
}


def chip_of(device: jax.Device, hbm_gib: float | None = None) -> Chip | None:
  """The `Chip` of `device` (None when unknown, e.g. a CPU); `hbm_gib` overrides or supplies its memory."""
  kind = device.device_kind
  chip = CHIPS.get(kind) or next((chip for name, chip in GPU_CHIPS.items() if name in kind), None)
  if hbm_gib is None:
    return chip
  if chip is None:
    return Chip(kind, hbm_gib * GIB, 0.0, 0.0)
  return dataclasses.replace(chip, hbm_bytes=hbm_gib * GIB)


def peak_flops(device: jax.Device) -> float | None:
  """The device's dense bf16 FLOP/s, the denominator of MFU; None where unknown (CPUs, unlisted devices)."""
  chip = chip_of(device)
  return chip.peak_flops if chip is not None and chip.peak_flops else None


def topology_devices(topology: str) -> list[jax.Device]:
  """The devices of a TPU topology such as "v5p:2x2x2" (chips along x, y, z), compilable from any host.

  Needs libtpu (`pip install "jax[tpu]==<your jax version>"`); no TPU is needed.
  """
  from jax.experimental import topologies

  # Only compiling: other processes that loaded libtpu (and hold its lock file) do not matter.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
  except Exception as error:  # libtpu absent, or a topology name it does not know
    raise ValueError(
      f"Cannot describe TPU topology {topology!r}: {error}. It needs libtpu "
      f'(pip install "jax[tpu]=={jax.__version__}") and a name like "v5p:2x2x1" (chips per axis).'
    ) from None


@dataclasses.dataclass
class Report:
  """One compiled program, per device. Sizes in bytes; None where the compile failed.

  loop_count: how many times the compiled cost must be counted for one run
    of what the report names (XLA's cost analysis counts a loop body once).
  traced_flops: the matrix-product FLOPs of one run per device, counted on
    the traced program (`matmul_flops`): rematerialisation included, loops at
    their trip count, custom kernels left out.
  """

  name: str
  devices: int
  chip: Chip | None
  loop_count: int = 1
  arguments: int | None = None
  outputs: int | None = None
  aliased: int | None = None
  temporaries: int | None = None
  flops: float | None = None
  bytes_accessed: float | None = None
  error_temporaries: int | None = None  # from the compiler's out-of-memory message, when the compile failed
  traced_flops: float | None = None
  model_flops: float | None = None  # the model FLOPs one run does per device (model/flops.py), for the MFU estimate
  compile_seconds: float | None = None  # lowering + compiling, on this host
  error: str = ""
  advice: list[str] = dataclasses.field(default_factory=list)

  @property
  def total(self) -> int | None:
    """Peak per-device bytes: arguments + outputs not aliased to (donated) arguments + temporaries.

    After an out-of-memory compile: arguments + the temporaries the compiler asked for (a lower bound).
    """
    if self.error:
      return None if self.error_temporaries is None else self.arguments + self.error_temporaries
    return self.arguments + self.outputs - self.aliased + self.temporaries

  @property
  def fits(self) -> bool | None:
    """Whether it fits the chip's HBM; None when the chip's memory is unknown."""
    if self.error:
      return False
    if self.chip is None:
      return None
    return self.total <= self.chip.hbm_bytes

  @property
  def estimated_seconds(self) -> float | None:
    """Roofline estimate: the slower of compute at peak FLOP/s and memory traffic at peak bandwidth.

    An estimate only: it ignores communication between devices and overlap.
    Every FLOP count falls short somewhere: the compiler's counts a loop body
    once (scanned layers, the chunked loss) and nothing inside a custom
    kernel (splash attention); the traced count has only matrix products;
    the model's has no rematerialisation. So compute is timed on the largest.
    Memory traffic comes from the compiler alone: without it (scanned layers)
    the estimate is compute time.
    """
    compiled = None if self.flops is None else self.loop_count * self.flops
    if self.chip is None or not self.chip.peak_flops or (compiled is None and self.traced_flops is None):
      return None
    counts = [count for count in (compiled, self.traced_flops, self.model_flops) if count is not None]
    compute = max(counts) / self.chip.peak_flops
    if self.bytes_accessed is None:
      return compute
    return max(compute, self.loop_count * self.bytes_accessed / self.chip.hbm_bandwidth)

  @property
  def estimated_mfu(self) -> float | None:
    """The MFU the roofline estimate implies: model FLOPs over what the chip does at peak in `estimated_seconds`.

    At most 1; below it by the FLOPs the compiled program adds (rematerialisation, masked attention blocks) and
    by memory-bound time; as rough as the estimate it divides by.
    """
    if self.model_flops is None or self.estimated_seconds is None:
      return None
    return self.model_flops / (self.estimated_seconds * self.chip.peak_flops)


# The TPU compiler's out-of-memory messages, e.g. "... the total memory required for HLO temporaries
# (128.00G) exceeds available HBM (95.74G)" or "Used 188.23G of 95.74G hbm".
_OOM = re.compile(r"temporaries \(([\d.]+)([KMGT]?)\)|Used ([\d.]+)([KMGT]?) of")
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": GIB, "T": 1024 * GIB}


def argument_bytes(arguments: Any) -> int:
  """Bytes one device holds of a pytree of `jax.ShapeDtypeStruct`s carrying shardings (the largest shard)."""
  leaves = [x for x in jax.tree.leaves(arguments) if isinstance(x, jax.ShapeDtypeStruct)]
  return sum(quant.stored_bytes(x.sharding.shard_shape(x.shape), x.dtype) for x in leaves)


def sub_jaxprs(values: Any):
  """The jaxprs among an equation's parameters (scan and remat bodies, cond branches), open or closed.

  By duck type: jax 0.12 removed `jax.core.jaxprs_in_params`, and the jaxpr classes moved between releases.
  """
  for value in values:
    if isinstance(value, (list, tuple)):
      yield from sub_jaxprs(value)
    elif hasattr(value, "eqns"):
      yield value
    elif hasattr(getattr(value, "jaxpr", None), "eqns"):
      yield value.jaxpr


def matmul_flops(jaxpr: Any) -> float:
  """FLOPs of the matrix products in a (closed) jaxpr: 2 x the multiply-adds of every `dot_general`.

  A `scan` body counts `length` times and a `cond` its costliest branch; a
  `shard_map` body, written per device, counts once per device of its mesh.
  What runs in a custom kernel (`pallas_call`) is not counted, nor a
  `while_loop` beyond one trip (its trip count is not in the trace). Recomputed
  activations are counted where the differentiated program recomputes them.
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      lhs, rhs = (v.aval.shape for v in eqn.invars)
      (_, rhs_contracting), (_, rhs_batch) = eqn.params["dimension_numbers"]
      rhs_free = [size for axis, size in enumerate(rhs) if axis not in (*rhs_contracting, *rhs_batch)]
      total += 2.0 * math.prod(lhs) * math.prod(rhs_free)
    elif name == "pallas_call":
      continue
    else:
      counts = [matmul_flops(sub) for sub in sub_jaxprs(eqn.params.values())]
      if not counts:
        continue
      if name == "cond":
        total += max(counts)
      elif name == "scan":
        total += eqn.params["length"] * sum(counts)
      elif name == "shard_map":
        total += eqn.params["mesh"].size * sum(counts)
      else:
        total += sum(counts)
  return total


def compile_report(
  name: str,
  lower: Callable[[], Any],
  arguments: Any,
  devices: Sequence[jax.Device],
  chip: Chip | None,
  loop_count: int = 1,
) -> Report:
  """Lower and compile (`lower()` returns a `jax.stages.Lowered` of `arguments`) and read off the per-device numbers.

  A compile the compiler rejects for lack of memory gives a report that does
  not fit, with the arguments' bytes and the temporaries it asked for.
  """
  report = Report(name=name, devices=len(devices), chip=chip, loop_count=loop_count)
  start = time.perf_counter()
  try:
    compiled = lower().compile()
  except Exception as error:  # the compiler's RESOURCE_EXHAUSTED is a JaxRuntimeError
    message = str(error)
    if "RESOURCE_EXHAUSTED" not in message:
      raise
    report.compile_seconds = time.perf_counter() - start
    report.error = message.splitlines()[0][:400]
    report.arguments = argument_bytes(arguments)
    asked = _OOM.search(message)
    if asked:
      size, unit = asked.group(1, 2) if asked.group(1) else asked.group(3, 4)
      report.error_temporaries = int(float(size) * _UNITS[unit])
    return report
  report.compile_seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  report.arguments = memory.argument_size_in_bytes
  report.outputs = memory.output_size_in_bytes
  report.aliased = memory.alias_size_in_bytes
  report.temporaries = memory.temp_size_in_bytes
  cost = compiled.cost_analysis() or {}
  cost = cost[0] if isinstance(cost, list) else cost
  report.flops = cost.get("flops")
  report.bytes_accessed = cost.get("bytes accessed")
  return report


def format_table(reports: Sequence[Report]) -> str:
  """A markdown table of the reports (GB = 1e9 bytes)."""

  def gb(value) -> str:
    return "–" if value is None else f"{value / 1e9:.3g}"

  rows = [
    "| program | devices | arguments GB | outputs GB | temporaries GB | total GB | HBM GB | fits | "
    "TFLOP | GB accessed | estimated s | MFU est. |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
  ]
  for r in reports:
    fits = {True: "yes", False: "NO", None: "?"}[r.fits]
    if r.flops is not None:
      flops = f"{r.flops * r.loop_count / 1e12:.3g}"
    else:
      flops = "–" if r.traced_flops is None else f"{r.traced_flops / 1e12:.3g} traced"
    accessed = "–" if r.bytes_accessed is None else gb(r.bytes_accessed * r.loop_count)
    estimate = "–" if r.estimated_seconds is None else f"{r.estimated_seconds:.3g}"
    mfu = "–" if r.estimated_mfu is None else f"{100 * r.estimated_mfu:.3g}%"
    hbm = "–" if r.chip is None else gb(r.chip.hbm_bytes)
    temporaries = gb(r.temporaries) if not r.error else f">= {gb(r.error_temporaries)}"
    total = gb(r.total) if not r.error else f">= {gb(r.total)}"
    rows.append(
      f"| {r.name} | {r.devices} | {gb(r.arguments)} | {gb(r.outputs)} | {temporaries} | {total} | "
      f"{hbm} | {fits} | {flops} | {accessed} | {estimate} | {mfu} |"
    )
  return "\n".join(rows)
