"""The decoding and serving benchmarks' rows as fixed-width text tables, with the ratios and checks read off them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from refusion_jax.evaluation.decode_bench import EAGER, Measurement
from refusion_jax.evaluation.quant_bench import REFERENCE, QuantRow
from refusion_jax.evaluation.serve_bench import ServeBenchRow
from refusion_jax.evaluation.throughput import ThroughputRow


def _bytes(count: int | None) -> str:
  if count is None:
    return "-"
  for unit in ("B", "KiB", "MiB", "GiB"):
    if count < 1024 or unit == "GiB":
      return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
    count /= 1024
  raise AssertionError("unreachable")


def _table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
  """Fixed-width columns: the first two left-aligned (names), the others right-aligned (numbers)."""
  widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
  fmt = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
  rule = "-" * len(fmt(header))
  return "\n".join([fmt(header), rule, *map(fmt, lines)])


def format_table(rows: Sequence[Measurement]) -> str:
  """The decode benchmark as a table, one line per measurement."""
  header = ("model", "method", "batch", "fwd/row", "TPF", "tokens/s", "compile s", "run s", "host ms/call", "KV cache")
  lines = [
    (
      r.model,
      r.method,
      str(r.batch),
      f"{r.forwards:.1f}",
      f"{r.tpf:.2f}",
      f"{r.tokens_per_s:.1f}",
      f"{r.compile_s:.2f}",
      f"{r.run_s:.3f}",
      "-" if r.host_ms is None else f"{r.host_ms:.2f}",
      _bytes(r.kv_cache_bytes),
    )
    for r in rows
  ]
  return _table(header, lines)


def summary(rows: Sequence[Measurement]) -> str:
  """Per model: jitted vs eager speed and agreement, and the batching speed-up of each method."""
  out = []
  for name in dict.fromkeys(r.model for r in rows):
    cell = {(r.method, r.batch): r for r in rows if r.model == name}
    jitted, eager = cell[("refusion", 1)], cell[(EAGER, 1)]
    same = "same tokens" if jitted.tokens == eager.tokens else "DIFFERENT tokens"
    out.append(f"{name}: jitted ReFusion is {eager.run_s / jitted.run_s:.1f}x the eager reference at batch 1 ({same}).")
    batch = max(b for _, b in cell)
    if batch > 1:
      gains = ", ".join(
        f"{m} {cell[(m, batch)].tokens_per_s / cell[(m, 1)].tokens_per_s:.1f}x" for m in ("refusion", "ar", "mdm")
      )
      out.append(f"{name}: tokens/s at batch {batch} over batch 1: {gains}.")
  return "\n".join(out)


def format_throughput(rows: Sequence[ThroughputRow]) -> str:
  """The throughput table, the same-tokens check, and the per-stage width histograms of the largest prompt count."""
  sequential = {r.prompts: r for r in rows if r.mode == "sequential"}
  header = ("prompts", "mode", "K", "fwd/answer", "batch fwds", "avg width", "tokens/s", "run s", "vs sequential")
  lines = [
    (
      str(r.prompts),
      r.mode,
      str(r.rows),
      f"{r.forwards_per_answer:.1f}",
      str(r.batch_forwards),
      f"{r.average_width:.1f}",
      f"{r.tokens_per_s:.0f}",
      f"{r.run_s:.3f}",
      f"{sequential[r.prompts].run_s / r.run_s:.2f}x",
    )
    for r in rows
  ]
  out = [_table(header, lines), ""]
  different = [f"{r.prompts} prompts {r.mode}" for r in different_from_sequential(rows)]
  out.append(f"DIFFERENT tokens from sequential: {different}" if different else "every mode: the same tokens.")
  for r in rows:
    if r.official:
      reference = sequential[r.prompts]
      out.append(
        f"{r.prompts} prompts at B = 1: the jitted decoder is {r.run_s / reference.run_s:.1f}x faster than the "
        f"official code ({r.mode}); {same_answers(r, reference)} of {r.prompts} answers identical."
      )
  largest = max(sequential)
  for r in rows:
    if r.prompts == largest and (r.mode == "sequential" or (r.mode.startswith("continuous") and r.rows > 1)):
      out.append(f"forward widths ({largest} prompts, {r.mode}), width x count:")
      for name, counts in r.widths.items():
        out.append(f"  {name:8s}" + "  ".join(f"{w:>3d} x {c:<5d}" for w, c in sorted(counts.items())))
  return "\n".join(out)


def different_from_sequential(rows: Sequence[ThroughputRow]) -> list[ThroughputRow]:
  """Our modes whose tokens differ from the sequential run's at the same prompt count (the official one aside)."""
  sequential = {r.prompts: r for r in rows if r.mode == "sequential"}
  return [r for r in rows if not r.official and r.tokens != sequential[r.prompts].tokens]


def same_answers(row: ThroughputRow, reference: ThroughputRow) -> int:
  """How many of `row`'s answers are identical to `reference`'s."""
  return sum(a == b for a, b in zip(row.tokens, reference.tokens))


def format_serve(rows: Sequence[ServeBenchRow]) -> str:
  """The serving table: each mode's rates and latency percentiles, and its speed over the first (one by one)."""
  percentile = lambda values, q: f"{np.percentile(values, q):.3f}" if values else "-"
  header = ("mode", "s", "requests/s", "answer tokens/s", "p50 s", "p99 s", "p50 first text s", "p99 first text s")
  lines = [
    (
      r.mode,
      f"{r.seconds:.2f}",
      f"{r.requests_per_s:.2f}",
      f"{r.tokens_per_s:.0f}",
      percentile(r.latencies, 50),
      percentile(r.latencies, 99),
      percentile(r.first_text, 50),
      percentile(r.first_text, 99),
    )
    for r in rows
  ]
  base = rows[0]
  ratios = ", ".join(f"{r.mode} {r.requests_per_s / base.requests_per_s:.2f}x" for r in rows[1:])
  same = ", ".join(f"{r.mode} {r.same_texts}/{len(r.latencies)}" for r in rows[1:])
  return "\n".join(
    [_table(header, lines), "", f"requests/s over {base.mode}: {ratios}.", f"texts equal to {base.mode}'s: {same}."]
  )


def format_quant(rows: list[QuantRow], source: str) -> str:
  """The rows as a markdown table, each variant's time per forward also as a ratio to bfloat16's."""
  reference = next(r for r in rows if r.name == REFERENCE)
  lines = [
    f"{source}: against {REFERENCE} (and float32); time = one ReFusion decode forward, compile excluded",
    "",
    "| variant | rel. logit error vs float32 | vs bfloat16 | top-1 = bfloat16 | greedy AR tokens = bfloat16 "
    "| parameters | ms / forward | time vs bfloat16 |",
    "| --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for r in rows:
    lines.append(
      f"| {r.name} | {r.error_vs_float32:.2e} | {r.error_vs_reference:.2e} | {100 * r.top1:.1f} % "
      f"| {100 * r.greedy_agreement:.1f} % | {_bytes(r.param_bytes)} | {1e3 * r.seconds_per_forward:.2f} "
      f"| {r.seconds_per_forward / reference.seconds_per_forward:.2f}x |"
    )
  return "\n".join(lines)
