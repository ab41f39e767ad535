"""A training run's learning curve per task, read back from its TensorBoard event files.

The trainer logs `eval/exact_match_<task>` (and `eval/exact_match`, `eval/tpf`)
at every evaluation; this module reads them without TensorFlow or TensorBoard
(the event file is a sequence of length-prefixed `Event` protos) and writes a
Markdown table and a PNG of accuracy against step, one line per task.
"""

from __future__ import annotations

import glob
import os
import struct

from tensorboardX.proto import event_pb2

TABLE = "learning_curve.md"
PLOT = "learning_curve.png"
_PREFIX = "eval/exact_match"


def read_scalars(logdir: str) -> dict[str, dict[int, float]]:
  """{tag: {step: value}} of every scalar in the event files under `logdir` (later files win on a repeated step)."""
  files = sorted(glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"), recursive=True))
  if not files:
    raise FileNotFoundError(f"No TensorBoard event files under {logdir!r}; pass a training workdir.")
  scalars: dict[str, dict[int, float]] = {}
  for path in files:
    with open(path, "rb") as f:
      data = f.read()
    offset = 0
    # Record: uint64 length, uint32 CRC of the length, the Event bytes, uint32 CRC of the bytes.
    while offset + 12 <= len(data):
      (length,) = struct.unpack("<Q", data[offset : offset + 8])
      event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
      offset += 12 + length + 4
      for value in event.summary.value:
        if value.HasField("simple_value"):
          scalars.setdefault(value.tag, {})[int(event.step)] = float(value.simple_value)
  return scalars


def accuracy_curves(scalars: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
  """{"all" or task name: {step: validation exact match}}."""
  curves = {}
  for tag, points in scalars.items():
    if tag == _PREFIX:
      curves["all"] = points
    elif tag.startswith(_PREFIX + "_"):
      curves[tag.removeprefix(_PREFIX + "_")] = points
  if not curves:
    raise ValueError("The event files hold no eval/exact_match scalars: did the run evaluate (eval_every > 0)?")
  return curves


def format_curve(curves: dict[str, dict[int, float]], tpf: dict[int, float]) -> str:
  """Markdown: one row per evaluation step, validation exact match % per task, then TPF."""
  names = sorted(n for n in curves if n != "all") + ["all"]
  steps = sorted({step for points in curves.values() for step in points})
  lines = ["| step | " + " | ".join(names) + " | TPF |", "|" + "---|" * (len(names) + 2)]
  for step in steps:
    cells = [f"{100 * curves[n][step]:.1f}" if step in curves[n] else "–" for n in names]
    cells.append(f"{tpf[step]:.2f}" if step in tpf else "–")
    lines.append(f"| {step} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def plot_curve(curves: dict[str, dict[int, float]], path: str, title: str = "") -> None:
  """Validation exact match against step, one line per task (the overall one dashed)."""
  # Imported here, when a plot is drawn; a bare Figure draws with Agg, leaving pyplot and the user's backend alone.
  from matplotlib.figure import Figure

  figure = Figure(figsize=(6.5, 4))
  axes = figure.add_subplot()
  for name in sorted(curves, key=lambda n: (n == "all", n)):
    steps = sorted(curves[name])
    axes.plot(steps, [curves[name][s] for s in steps], marker="o", linestyle="--" if name == "all" else "-", label=name)
  axes.set_xlabel("training step")
  axes.set_ylabel("validation exact match")
  axes.set_ylim(-0.02, 1.02)
  axes.axhline(0.8, color="grey", linewidth=0.8, linestyle=":")
  axes.grid(True, alpha=0.3)
  axes.legend(fontsize=8)
  if title:
    axes.set_title(title, fontsize=10)
  figure.tight_layout()
  figure.savefig(path, dpi=150)


def write_curve(workdir: str, out_dir: str, title: str = "") -> list[str]:
  """Write `learning_curve.md` and `learning_curve.png` of the run in `workdir`; returns their paths."""
  scalars = read_scalars(workdir)
  curves = accuracy_curves(scalars)
  os.makedirs(out_dir, exist_ok=True)
  table_path, plot_path = os.path.join(out_dir, TABLE), os.path.join(out_dir, PLOT)
  with open(table_path, "w", encoding="utf-8") as f:
    f.write((f"{title}\n\n" if title else "") + format_curve(curves, scalars.get("eval/tpf", {})))
  plot_curve(curves, plot_path, title.lstrip("# "))
  return [table_path, plot_path]
