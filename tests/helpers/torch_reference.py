"""torch for the parity tests, or a skip of the module that imports it when torch is not installed.

The test extra installs a CPU torch on Python 3.11 only; for Python >= 3.12 PyPI serves CUDA builds
(2.6 GB of wheels with their CUDA libraries), so there these modules skip unless torch is installed by hand.
"""

import pytest

torch = pytest.importorskip(
  "torch", reason="the transformers parity references need torch (on Python >= 3.12: pip install torch)"
)
