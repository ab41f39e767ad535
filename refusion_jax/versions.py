"""The package's own version and the jax versions it runs on, said once: setup.py reads its version and installs
from these lines, `import refusion_jax` checks the installed jax against them (and exports `__version__`), and
.ci/run tests both ends (jax 0.10.2 on Python 3.11, the newest the registry serves on Python 3.12).

Imports nothing but the standard library: setup.py reads this file before anything is installed, and
`import refusion_jax` stays cheap (the check reads jax/version.py as text, not jax: 0.2 ms where reading
the installed distributions' metadata takes 28 ms).
"""

import importlib.util
import os
import re
import sys
import warnings

# This release (CHANGELOG.md says what each one changed).
__version__ = "0.3.0"

# jax 0.11 dropped Python 3.11, so each Python gets the jax line it can run, and the flax that imports under
# it: flax 0.12.8 is the newest for Python 3.11 (and fails to import under jax >= 0.11.1); on Python >= 3.12,
# flax 0.12.9 imports under jax 0.11.1 only, 0.12.10 under jax 0.11.1 through 0.12.
JAX_LINES = {
  'python_version < "3.12"': (">=0.10.2,<0.11", ">=0.12.8,<0.13"),
  'python_version >= "3.12"': (">=0.11.1,<0.13", ">=0.12.10,<0.13"),
}
# Every jax the code runs on, whichever Python (a jax installed by hand may sit off its Python's line).
OLDEST_JAX, FIRST_UNTESTED_JAX = (0, 10, 2), (0, 13)
# The GPU's fused attention where jax no longer ships its own (refusion_jax.model.flash): the tokamax release it
# was tested with, since its attention is read from a module tokamax does not promise to keep.
TOKAMAX = "tokamax>=0.0.17,<0.0.18"


def _release(version: str) -> tuple[int, ...]:
  """(0, 12, 1) of "0.12.1", "0.12.1rc1" or "0.12.1.dev20261201"."""
  parts = []
  for part in version.split("."):
    digits = part[: len(part) - len(part.lstrip("0123456789"))]
    if not digits:
      break
    parts.append(int(digits))
    if len(digits) < len(part):
      break
  return tuple(parts)


def _installed_jax() -> str | None:
  """The installed jax's version without importing jax; None when jax is not installed."""
  spec = importlib.util.find_spec("jax")
  if spec is None or not spec.submodule_search_locations:
    return None
  try:
    with open(os.path.join(spec.submodule_search_locations[0], "version.py"), encoding="utf-8") as f:
      found = re.search(r'^_version\s*(?::\s*str\s*)?=\s*"([^"]+)"', f.read(), re.MULTILINE)
  except OSError:
    found = None
  if found:
    return found.group(1)
  from importlib import metadata  # 28 ms with what it imports: only when jax/version.py does not say

  return metadata.version("jax")


def _window() -> str:
  return ".".join(map(str, OLDEST_JAX)) + " <= jax < " + ".".join(map(str, FIRST_UNTESTED_JAX))


def check_jax(version: str | None = None) -> None:
  """Refuses a jax older than the window (ImportError naming it and the install that fixes it); warns on a
  newer one, which the code was not tested with. `version`: the installed jax's, by default."""
  version = version or _installed_jax()
  if version is None:
    return  # `import jax` itself then says what is missing
  python = "3.11" if sys.version_info < (3, 12) else "3.12+"
  release = _release(version)
  if release < OLDEST_JAX:
    raise ImportError(
      f"refusion_jax runs on {_window()}, but jax {version} is installed; on Python {python} "
      'reinstall the package with its pins (pip install -e .) or see README.md "Install on a GPU / TPU VM / notebook".'
    )
  if release >= FIRST_UNTESTED_JAX:
    warnings.warn(
      f"refusion_jax was tested on {_window()}; jax {version} is newer: if something fails, "
      "pip install -e . (its pins) restores a tested jax.",
      RuntimeWarning,
      stacklevel=3,
    )
