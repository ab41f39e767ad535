"""docs/sampling.ipynb runs headlessly on a random tiny model, and is committed without outputs."""

import os

import nbformat
from helpers.train_utils import REPO
from nbclient import NotebookClient

NOTEBOOK = os.path.join(REPO, "docs", "sampling.ipynb")


def test_notebook_is_stored_without_outputs():
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(notebook)
  for cell in notebook.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, "strip the outputs before committing"


def test_notebook_executes_on_a_random_model(monkeypatch):
  # The kernel is a subprocess: it inherits this environment (the repo on the path, CPU only, no checkpoint).
  monkeypatch.setenv("REFUSION_NOTEBOOK_CHECKPOINT", "")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": REPO}}).execute()
  outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  assert any("image/png" in o.get("data", {}) for o in outputs), "the fill-order picture is not shown inline"
  text = "".join(o.get("text", "") for o in outputs)
  assert "random tiny model" in text
  assert "forwards/answer" in text and "wall-clock ReFusion / AR" in text
  assert text.count(" -> ") == 6
