"""Pictures of the decode order, as the paper's demo shows it.

The answer is laid out by true position, wrapped into rows of a fixed number
of tokens; each token's text sits in a cell coloured by the iteration that
committed it, so parallel commits show as runs of one colour and the
left-to-right order (or its absence) is visible at a glance. How a token was
committed is marked too: hatched cells (or underlined text in the terminal)
came from the parallel infill, plain ones from the global verification or a
baseline step.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from refusion_jax.data.tokenizer import Tokenizer
from refusion_jax.decoding.result import PHASE_INFILL, PHASE_NAMES, DecodeResult

# matplotlib is imported by the functions that draw: a decode never pays its import time.
if TYPE_CHECKING:
  import matplotlib.colors
  from matplotlib.figure import Figure

COLORMAP = "viridis"
# Hatch of each phase in the figure (verification / baseline step: plain).
_HATCH = {PHASE_INFILL: "//"}
_UNCOMMITTED_RGB = (0.8, 0.8, 0.8)


def token_texts(tokens: list[int], tokenizer: Tokenizer | None) -> list[str]:
  """One printable label per token: its decoded text with whitespace made visible, else its id."""
  if tokenizer is None:
    return [str(t) for t in tokens]
  texts = []
  for token in tokens:
    text = tokenizer.decode([token])
    text = text.replace("\n", "\u21b5").replace("\t", "\u2192").replace(" ", "\u00b7")
    text = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)
    # A lone piece of a multi-byte character decodes to U+FFFD: its id says more.
    texts.append(text if text.strip("\ufffd") else f"<{token}>")
  return texts


def _iteration_colours(iterations: np.ndarray) -> tuple[np.ndarray, matplotlib.colors.Normalize]:
  """RGB [N, 3] per token from its commit iteration (grey where none), and the colour scale."""
  import matplotlib.colors

  top = max(int(iterations.max(initial=0)), 1)
  norm = matplotlib.colors.Normalize(vmin=0, vmax=top)
  rgb = matplotlib.colormaps[COLORMAP](norm(iterations))[:, :3]
  rgb[iterations < 0] = _UNCOMMITTED_RGB
  return rgb, norm


def _text_on(rgb) -> str:
  """Black or white text, whichever reads better on the background."""
  luminance = 0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2]
  return "black" if luminance > 0.5 else "white"


def _title(result: DecodeResult, row: int) -> str:
  count = len(result.tokens[row])
  return (
    f"row {row}: {count} tokens in {int(result.steps[row])} iterations, "
    f"{int(result.num_forwards[row])} forwards, TPF {result.tpf[row]:.2f}"
  )


def _row_trace(result: DecodeResult, row: int) -> tuple[list[int], np.ndarray, np.ndarray]:
  tokens = result.tokens[row]
  count = len(tokens)
  return tokens, np.asarray(result.commit_iteration[row, :count]), np.asarray(result.commit_phase[row, :count])


def plot_trace(
  result: DecodeResult,
  row: int = 0,
  tokenizer: Tokenizer | None = None,
  path: str | None = None,
  tokens_per_line: int = 16,
) -> Figure:
  """Draw one row's answer as a grid of cells coloured by commit iteration.

  Args:
    result: a decode result (ReFusion or a baseline).
    row: which batch row to draw.
    tokenizer: renders each token's text; without one the ids are shown.
    path: if given, the figure is also saved there (format from the suffix).
    tokens_per_line: cells per grid row.

  Returns:
    The figure. Its axes hold exactly one `Rectangle` patch per answer token
    (gid "token"), in position order.
  """
  import matplotlib.cm
  import matplotlib.patches
  import matplotlib.ticker
  from matplotlib.figure import Figure  # a bare Figure renders with Agg and never touches pyplot or a display

  tokens, iterations, phases = _row_trace(result, row)
  texts = token_texts(tokens, tokenizer)
  rgb, norm = _iteration_colours(iterations)
  lines = max(1, -(-len(tokens) // tokens_per_line))

  fig = Figure(figsize=(1.0 + 0.75 * tokens_per_line, 1.2 + 0.45 * lines), layout="constrained")
  ax = fig.add_subplot()
  for pos, (text, colour, phase) in enumerate(zip(texts, rgb, phases)):
    x, y = pos % tokens_per_line, pos // tokens_per_line
    ax.add_patch(
      matplotlib.patches.Rectangle(
        (x, y),
        1,
        1,
        facecolor=colour,
        edgecolor="white",
        linewidth=1.5,
        hatch=_HATCH.get(int(phase)),
        gid="token",
      )
    )
    label = text if len(text) <= 6 else text[:5] + "\u2026"
    ax.text(
      x + 0.5,
      y + 0.5,
      label,
      ha="center",
      va="center",
      fontsize=9,
      fontweight="bold",
      color=_text_on(colour),
      parse_math=False,
      bbox=dict(boxstyle="round,pad=0.1", facecolor=colour, edgecolor="none"),
    )
  ax.set_xlim(0, tokens_per_line)
  ax.set_ylim(lines, 0)
  ax.set_aspect("equal")
  ax.axis("off")
  ax.set_title(_title(result, row), fontsize=10)

  mappable = matplotlib.cm.ScalarMappable(norm=norm, cmap=COLORMAP)
  bar = fig.colorbar(mappable, ax=ax, label="commit iteration", shrink=0.9)
  bar.ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
  present = sorted({int(p) for p in phases if int(p) in PHASE_NAMES})
  handles = [
    matplotlib.patches.Patch(facecolor="white", edgecolor="black", hatch=_HATCH.get(p), label=PHASE_NAMES[p])
    for p in present
  ]
  if handles:
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, 0), ncol=len(handles), frameon=False, fontsize=8)
  if path is not None:
    fig.savefig(path, dpi=120)
  return fig


def _xterm_code(rgb) -> int:
  """Nearest colour of the xterm 6x6x6 colour cube (codes 16..231)."""
  r, g, b = (int(round(c * 5)) for c in rgb)
  return 16 + 36 * r + 6 * g + b


@functools.cache
def _terminal_ramp() -> tuple[int, ...]:
  """The colormap as the distinct xterm codes it passes through, in order (15 for viridis)."""
  import matplotlib

  codes = [_xterm_code(c) for c in matplotlib.colormaps[COLORMAP](np.linspace(0, 1, 256))[:, :3]]
  return tuple(c for i, c in enumerate(codes) if i == 0 or c != codes[i - 1])


_UNCOMMITTED_CODE = 250


def _terminal_code(iteration: int, top: int) -> int:
  """Distinct codes for distinct iterations as long as there are at most 15 of them."""
  ramp = _terminal_ramp()
  if iteration < 0:
    return _UNCOMMITTED_CODE
  return ramp[round(iteration / max(top, 1) * (len(ramp) - 1))]


def _ansi_cell(text: str, code: int, underline: bool) -> str:
  cube = code - 16
  rgb = (cube // 36 / 5, cube // 6 % 6 / 5, cube % 6 / 5) if code < 232 else (0.8, 0.8, 0.8)
  foreground = 16 if _text_on(rgb) == "black" else 231
  style = "4;" if underline else ""
  return f"\x1b[{style}38;5;{foreground};48;5;{code}m{text}\x1b[0m"


def format_trace_terminal(result: DecodeResult, row: int = 0, tokenizer: Tokenizer | None = None) -> str:
  """One row's answer with an ANSI 256-colour background per commit iteration.

  Returns:
    A title line, the answer (one coloured cell per token; infill commits
    underlined; ids separated by spaces when no tokenizer is given), and a last
    line with the legend: one coloured swatch per iteration.
  """
  tokens, iterations, phases = _row_trace(result, row)
  top = max(int(iterations.max(initial=0)), 1)
  texts = token_texts(tokens, tokenizer)
  if tokenizer is None:
    texts = [t + " " for t in texts]
  body = "".join(
    _ansi_cell(t, _terminal_code(int(i), top), int(p) == PHASE_INFILL) for t, i, p in zip(texts, iterations, phases)
  )
  # Past the ramp's length, neighbouring iterations share a colour: label one per colour.
  shown = sorted({round(i) for i in np.linspace(0, top, min(top + 1, len(_terminal_ramp())))})
  swatches = "".join(_ansi_cell(f"{i:^3}", _terminal_code(i, top), False) for i in shown)
  legend = f"iteration: {swatches}  (underlined: committed by the parallel infill)"
  return "\n".join([_title(result, row), body, legend])
