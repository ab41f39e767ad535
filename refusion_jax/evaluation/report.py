"""Result files of `python -m refusion_jax.eval --out` -> a Markdown table and a speed–accuracy plot.

The table follows the paper's: one row per model and decode setting, and per
task (and overall) accuracy / tokens per forward / tokens per second. One table
per test set (a built-in split, or a JSON file). The plot puts every row of the
test set with the most rows at (tokens per second, accuracy) and marks the Pareto front: the
settings no other setting beats on both speed and accuracy.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence

TABLE = "table.md"
PLOT = "speed_accuracy.png"


def read_results(results_dir: str) -> list[dict]:
  """Every result file (a JSON object with `label`, `method` and `metrics`) under `results_dir`, sorted by path."""
  if not os.path.isdir(results_dir):
    raise FileNotFoundError(f"{results_dir!r} is not a directory of result files (written by eval --out).")
  results = []
  for path in sorted(glob.glob(os.path.join(results_dir, "**", "*.json"), recursive=True)):
    with open(path, encoding="utf-8") as f:
      try:
        record = json.load(f)
      except json.JSONDecodeError:
        continue  # not ours
    if isinstance(record, dict) and {"label", "method", "metrics"} <= set(record):
      results.append(record)
  if not results:
    raise FileNotFoundError(f"No result files under {results_dir!r}; write some with `refusion_jax.eval --out`.")
  return results


def test_set_name(record: dict) -> str:
  """`test split` for a built-in split, the file name for a JSON test set."""
  data = record.get("data", {})
  return os.path.basename(data["file"]) if "file" in data else f"{data.get('split', '?')} split"


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
  """Indices of the points (speed, accuracy) that no other point matches or beats on both with one strictly better."""

  def dominated(i: int) -> bool:
    x, y = points[i]
    return any(ox >= x and oy >= y and (ox > x or oy > y) for ox, oy in points)

  return [i for i in range(len(points)) if not dominated(i)]


def _cell(group: dict | None) -> str:
  if group is None:
    return "–"
  return f"{100 * group['accuracy']:.1f} / {group['tpf']:.2f} / {group['tokens_per_s']:.0f}"


def format_table(results: Sequence[dict]) -> str:
  """One Markdown table per test set; cells are accuracy % / TPF / tokens per second."""
  sections = []
  for test_set in dict.fromkeys(test_set_name(r) for r in results):
    rows = [r for r in results if test_set_name(r) == test_set]
    tasks = sorted({task for r in rows for task in r["metrics"]["by_task"]})
    header = ["model", "decoding", *tasks, "all", "forwards / answer", "ms / forward"]
    lines = [
      f"**{test_set}** — accuracy % / tokens per forward / tokens per second (compilation excluded); "
      "ms / forward: decode time ÷ the forwards the batches ran",
      "",
      "| " + " | ".join(header) + " |",
      "|" + "---|" * len(header),
    ]
    front = {id(rows[i]) for i in pareto_front([_point(r) for r in rows])}
    for r in rows:
      metrics = r["metrics"]
      label = r["label"] + (" ★" if id(r) in front else "")
      cells = [r["model"], label, *(_cell(metrics["by_task"].get(t)) for t in tasks), _cell(metrics)]
      cost = f"{1e3 * metrics['seconds_per_forward']:.2f}" if "seconds_per_forward" in metrics else "–"
      lines.append("| " + " | ".join([*cells, f"{metrics['mean_forwards']:.1f}", cost]) + " |")
    sections.append("\n".join(lines))
  legend = "★ on the speed–accuracy Pareto front of its test set (no other row is both faster and more accurate)."
  return "\n\n".join(sections) + "\n\n" + legend + "\n"


def _point(record: dict) -> tuple[float, float]:
  return record["metrics"]["tokens_per_s"], record["metrics"]["accuracy"]


def plot_speed_accuracy(results: Sequence[dict], path: str) -> None:
  """Accuracy vs tokens per second on the test set with the most rows, one colour per model, Pareto front joined."""
  # Imported here, when a plot is drawn; a bare Figure draws with Agg, leaving pyplot and the user's backend alone.
  import matplotlib
  from matplotlib.figure import Figure

  names = [test_set_name(r) for r in results]
  test_set = max(dict.fromkeys(names), key=names.count)
  rows = [r for r in results if test_set_name(r) == test_set]
  points = [_point(r) for r in rows]
  figure = Figure(figsize=(7.5, 5))
  axes = figure.add_subplot()
  models = list(dict.fromkeys(r["model"] for r in rows))
  colours = matplotlib.colormaps["tab10"]
  for index, model in enumerate(models):
    mine = [p for r, p in zip(rows, points) if r["model"] == model]
    axes.scatter(*zip(*mine), color=colours(index % 10), label=model, s=36, zorder=3)
  on_front = pareto_front(points)
  front = sorted(points[i] for i in on_front)
  axes.plot(*zip(*front), color="black", linestyle="--", linewidth=1, zorder=2, label="Pareto front")
  axes.scatter(*zip(*front), facecolors="none", edgecolors="black", s=110, zorder=4)
  for i in on_front:  # only the front is labelled: the rest would be unreadable
    axes.annotate(
      f"{rows[i]['model']}: {rows[i]['label']}", points[i], fontsize=6, xytext=(4, 4), textcoords="offset points"
    )
  axes.set_xscale("log")
  axes.set_xlabel("tokens per second (log scale, compilation excluded)")
  axes.set_ylabel(f"accuracy ({test_set})")
  axes.grid(True, which="both", alpha=0.3)
  axes.legend(fontsize=8)
  figure.tight_layout()
  figure.savefig(path, dpi=150)


def write_report(results_dir: str, out_dir: str, title: str = "") -> list[str]:
  """Write `table.md` and `speed_accuracy.png` into `out_dir`; returns their paths."""
  results = read_results(results_dir)
  os.makedirs(out_dir, exist_ok=True)
  table_path, plot_path = os.path.join(out_dir, TABLE), os.path.join(out_dir, PLOT)
  with open(table_path, "w", encoding="utf-8") as f:
    f.write((f"{title}\n\n" if title else "") + format_table(results))
  plot_speed_accuracy(results, plot_path)
  return [table_path, plot_path]
