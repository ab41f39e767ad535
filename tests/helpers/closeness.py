"""How close our logits are to a reference's: the one measure every parity and cache test uses."""

import chex
import numpy as np


def assert_logits_close(ours, reference, tolerance: float) -> None:
  """Every |ours - reference| <= tolerance * max |reference| (chex names the worst entries when not)."""
  reference = np.asarray(reference, np.float64)
  chex.assert_trees_all_close(np.asarray(ours, np.float64), reference, rtol=0, atol=tolerance * np.abs(reference).max())


def relative_error(ours, reference) -> float:
  """max |ours - reference| / max |reference|."""
  ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
  return float(np.abs(ours - reference).max() / np.abs(reference).max())
