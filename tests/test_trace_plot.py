"""The decode-order pictures: one coloured cell per answer token, in the figure and the terminal."""

import re

import numpy as np
import pytest

from refusion_jax.data.tokenizer import ByteTokenizer
from refusion_jax.decoding.result import PHASE_INFILL, PHASE_NONE, PHASE_VERIFY, DecodeResult
from refusion_jax.decoding.trace_plot import format_trace_terminal, plot_trace

BACKGROUND = re.compile(r"\x1b\[(?:4;)?38;5;\d+;48;5;(\d+)m")


def random_result(seed, lengths, gen_length=24):
  """A ReFusion-like result: random byte tokens committed over a few iterations in random order."""
  rng = np.random.default_rng(seed)
  iteration = np.full((len(lengths), gen_length), -1)
  phase = np.full((len(lengths), gen_length), PHASE_NONE)
  tokens = []
  for row, n in enumerate(lengths):
    tokens.append(rng.integers(32, 127, size=n).tolist())
    iteration[row, :n] = rng.integers(0, 6, size=n)
    phase[row, :n] = rng.choice([PHASE_VERIFY, PHASE_INFILL], size=n)
  return DecodeResult(
    tokens=tokens,
    num_forwards=rng.integers(5, 20, size=len(lengths)),
    steps=np.full(len(lengths), 6),
    commit_iteration=iteration,
    commit_phase=phase,
  )


def token_cells(fig):
  return [p for p in fig.axes[0].patches if p.get_gid() == "token"]


@pytest.mark.parametrize("row", [0, 1])
def test_plot_has_one_cell_per_token_coloured_by_iteration(tmp_path, row):
  result = random_result(0, [21, 7])
  path = tmp_path / "trace.png"
  fig = plot_trace(result, row, tokenizer=ByteTokenizer(), path=str(path), tokens_per_line=8)
  assert path.stat().st_size > 1000
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  cells = token_cells(fig)
  count = len(result.tokens[row])
  assert len(cells) == count
  iterations = result.commit_iteration[row, :count]
  colours = [tuple(c.get_facecolor()) for c in cells]
  # Same iteration <-> same colour.
  for i in range(count):
    for j in range(count):
      assert (colours[i] == colours[j]) == (iterations[i] == iterations[j])
  hatched = [c.get_hatch() is not None for c in cells]
  assert hatched == list(result.commit_phase[row, :count] == PHASE_INFILL)
  # Cells wrap into rows of 8 by position.
  assert [tuple(c.get_xy()) for c in cells] == [(p % 8, p // 8) for p in range(count)]
  assert "TPF" in fig.axes[0].get_title()


def test_plot_without_tokenizer_labels_cells_with_ids():
  result = random_result(1, [5])
  fig = plot_trace(result, 0)
  labels = [t.get_text() for t in fig.axes[0].texts]
  assert labels == [str(t) for t in result.tokens[0]]


def test_terminal_trace_has_one_colour_code_per_token():
  result = random_result(2, [18, 3])
  text = format_trace_terminal(result, 0, tokenizer=ByteTokenizer())
  title, body, legend = text.split("\n")
  codes = [int(c) for c in BACKGROUND.findall(body)]
  assert len(codes) == 18
  iterations = result.commit_iteration[0, :18]
  for i in range(18):
    for j in range(18):
      assert (codes[i] == codes[j]) == (iterations[i] == iterations[j])
  assert body.count("\x1b[4;") == int(np.sum(result.commit_phase[0, :18] == PHASE_INFILL))
  assert len(BACKGROUND.findall(legend)) == int(iterations.max()) + 1
  assert "forwards" in title
  plain = re.sub(r"\x1b\[[0-9;]*m", "", body)
  assert plain == "".join(chr(t) for t in result.tokens[0]).replace(" ", "\u00b7")
