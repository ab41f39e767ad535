"""launch/experiment.sh end to end on the smoke configs: four trainings, the sweeps, the table and the plot."""

import os
import subprocess

import pytest
from helpers.train_utils import REPO


@pytest.mark.slow
def test_experiment_script_trains_sweeps_and_reports(tmp_path):
  env = dict(os.environ, VARIANT="smoke", RESULTS=str(tmp_path / "results"))
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
  out = tmp_path / "run"
  command = ["bash", "launch/experiment.sh", str(out), "4", "6"]
  result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
  log = (out / "experiment.log").read_text() if (out / "experiment.log").exists() else ""
  assert result.returncode == 0, result.stderr + log[-3000:]
  assert "Traceback" not in log
  table = (tmp_path / "results" / "table.md").read_text()
  assert "**test split**" in table and "**test_set.json**" in table
  rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| model")]
  models = [row.split(" | ")[0].removeprefix("| ") for row in rows]
  # split: AR 1, MDM 2 block lengths x 3 step counts (clamped to the smoke G = 16), ReFusion 3 x 2 x 2 each;
  # the JSON set: one default setting per model
  assert models.count("ReFusion") == models.count("ReFusion from AR") == 12 + 1
  assert models.count("AR") == 2 and models.count("MDM") >= 2
  assert (tmp_path / "results" / "speed_accuracy.png").read_bytes()[:4] == b"\x89PNG"
  assert sorted(p.name for p in out.glob("*.done")) == ["ar.done", "mdm.done", "refusion.done", "refusion_from_ar.done"]
