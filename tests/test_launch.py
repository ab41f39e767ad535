"""The pod and SLURM launchers' --dry_run: every command, printed so that a shell reads it back unchanged."""

import os
import re
import shlex
import stat
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDE = "--config.data.train_files=/mnt/it's here.json"  # a quote and a space to survive two shells


@pytest.fixture
def no_cloud_tools(tmp_path):
  """A PATH whose gcloud / sbatch / srun / scancel / tail record that they were called (a dry run calls none)."""
  calls = tmp_path / "calls"
  for tool in ("gcloud", "sbatch", "srun", "scancel", "tail", "python3", "mkdir"):
    script = tmp_path / tool
    script.write_text(f"#!/bin/sh\necho {tool} >> {calls}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
  env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
  return env, calls


def dry_run(script: str, args: list[str], env: dict) -> list[str]:
  out = subprocess.run(
    ["bash", os.path.join(REPO, "launch", script), "--dry_run", *args],
    capture_output=True,
    text=True,
    env=env,
    timeout=60,
  )
  assert out.returncode == 0, out.stderr
  return out.stdout.splitlines()


def command(lines: list[str], *words: str) -> list[str]:
  """The one printed command containing every word, as the shell would split it."""
  found = [shlex.split(line) for line in lines if not line.startswith("#") and all(w in line for w in words)]
  assert len(found) == 1, (words, lines)
  return found[0]


def test_tpu_pod_dry_run_prints_the_whole_lifecycle(no_cloud_tools):
  env, calls = no_cloud_tools
  mount = "gcsfuse --implicit-dirs bucket /mnt/work"
  args = ["--accelerator=v5p-128", "--spot", f"--setup={mount}", "--max_restarts=5", "pod", "us-east5-a"]
  args.append("configs/refusion_qwen3_8b.py")
  lines = dry_run("tpu_pod.sh", [*args, "/mnt/work", OVERRIDE], env)
  create = command(lines, "queued-resources create")
  assert create[create.index("--accelerator-type") + 1] == "v5p-128" and "--spot" in create
  assert create[create.index("--runtime-version") + 1] == "v2-alpha-tpuv5"
  assert command(lines, "queued-resources describe")[-1] == "value(state.state)"
  assert command(lines, "gcsfuse")[-1] == mount
  assert command(lines, "tpu-vm scp")[-1] == "pod:~/refusion_jax"
  assert "pip install -q -e '.[tpu]'" in command(lines, "pip install")[-1]
  remote = command(lines, "nohup")
  assert "--worker=all" in remote
  train = shlex.split(remote[-1].split("&&", 1)[1])  # what runs on each worker
  # Each worker restarts its process on status 75 (a host lost or stalled), at most --max_restarts times.
  assert train[:8] == [
    "REFUSION_DISTRIBUTED=1",
    "nohup",
    "bash",
    "launch/restarting.sh",
    "5",
    "python3",
    "-m",
    "refusion_jax.train",
  ]
  assert train[train.index("--workdir") + 1] == "/mnt/work" and OVERRIDE in train
  assert command(lines, "tail -f")[-1] == "tail -f ~/refusion_train.log"
  assert command(lines, "pkill")[-1] == 'pkill -TERM -f "refusion_jax.train --config"'
  assert [line for line in lines if line.startswith("#")][:4] == [
    "# create",
    "# wait until the queued resource is ACTIVE:",
    "# set up",
    "# run",
  ]
  assert not calls.exists()


def test_tpu_pod_dry_run_of_the_grpo_recipe_as_its_config_gives_it(no_cloud_tools):
  """configs/grpo_qwen3_8b.py's launch command, dry run: every worker of the v5p slice trains the GRPO config
  with its overrides."""
  env, calls = no_cloud_tools
  with open(os.path.join(REPO, "configs", "grpo_qwen3_8b.py")) as f:
    text = f.read()
  given = re.search(r"^ *launch/tpu_pod\.sh (.*?)\n(?! *--config)", text.replace("\\\n", "\n"), re.M | re.S)
  args = shlex.split(given.group(1).replace("\n", " "))
  assert args[:2] == ["--accelerator=v5p-16", "my-tpu"] and "configs/grpo_qwen3_8b.py" in args, args
  lines = dry_run("tpu_pod.sh", args, env)
  create = command(lines, "queued-resources create")
  assert create[create.index("--accelerator-type") + 1] == "v5p-16"
  remote = command(lines, "nohup")
  assert "--worker=all" in remote
  train = shlex.split(remote[-1].split("&&", 1)[1])
  assert train[train.index("refusion_jax.train") + 1 :][:4] == [
    "--config",
    "configs/grpo_qwen3_8b.py",
    "--workdir",
    "/mnt/b/grpo",
  ]
  assert (
    "--config.init_from=/mnt/b/refusion_qwen3_8b" in train and "--config.data.train_files=/mnt/b/prompts.json" in train
  )
  assert not calls.exists()


def test_tpu_pod_steps_and_usage(no_cloud_tools):
  env, calls = no_cloud_tools
  assert command(dry_run("tpu_pod.sh", ["delete", "pod", "zone-a"], env), "delete")[-2:] == ["--force", "--quiet"]
  create = dry_run("tpu_pod.sh", ["--accelerator=v4-32", "create", "pod", "zone-a"], env)
  assert command(create, "create")[-1] == "tpu-ubuntu2204-base" and not any("ssh" in line for line in create)
  assert "--worker=0" in command(dry_run("tpu_pod.sh", ["logs", "pod", "zone-a"], env), "tail")
  usage = subprocess.run(["bash", os.path.join(REPO, "launch", "tpu_pod.sh")], capture_output=True, text=True, env=env)
  assert usage.returncode == 2 and "--dry_run" in usage.stdout
  assert not calls.exists()


def test_slurm_dry_run_prints_setup_job_logs_and_stop(no_cloud_tools):
  env, calls = no_cloud_tools
  args = ["--nodes=2", "--gpus_per_node=4", "--partition=gpu", "configs/refusion_qwen3_8b.py", "/shared/run", OVERRIDE]
  lines = dry_run("slurm_gpu.sh", args, env)
  install = command(lines, "pip install")
  assert install[0] == "/shared/run/venv/bin/pip" and install[-1].endswith("[cuda12]")
  sbatch = command(lines, "sbatch")[:-1]  # the last word is the here-document marker
  for flag, value in (("--nodes", "2"), ("--ntasks-per-node", "4"), ("--gpus-per-node", "4"), ("--signal", "TERM@120")):
    assert sbatch[sbatch.index(flag) + 1] == value, flag
  assert "--requeue" in sbatch and sbatch[sbatch.index("--partition") + 1] == "gpu"
  job = lines[lines.index(next(line for line in lines if line.startswith("sbatch"))) + 1 : lines.index("JOB")]
  # The job runs srun again when a task exits with 75 (its marker file says so: srun reports one status for all).
  assert "export REFUSION_RESTART_MARKER=/shared/run/.restart_requested" in job
  assert job[-2] == "bash launch/restarting.sh 3 \\"
  srun = shlex.split(job[-1])
  assert srun[:4] == ["srun", "--kill-on-bad-exit=1", "env", "REFUSION_DISTRIBUTED=1"]
  assert srun[srun.index("--workdir") + 1] == "/shared/run" and OVERRIDE in srun
  assert command(lines, "tail -f") == ["tail", "-f", "/shared/run/slurm-JOB_ID.out"]
  assert command(lines, "scancel") == ["scancel", "--signal=TERM", "JOB_ID"]
  assert command(dry_run("slurm_gpu.sh", ["stop", "123", "/shared/run"], env), "scancel")[-1] == "123"
  assert not calls.exists()


@pytest.mark.parametrize("marker", [False, True])
def test_restarting_runs_the_command_again_on_status_75_at_most_max_restarts_times(tmp_path, marker):
  runs, flag = tmp_path / "runs", tmp_path / "restart_requested"
  # Exits 75 twice (or, under srun, 1 with the marker file made), then 3: two restarts, then status 3.
  body = 'echo run >> "$RUNS"; n=$(wc -l < "$RUNS"); if [ "$n" -lt 3 ]; then '
  body += 'touch "$MARKER"; exit 1; fi; exit 3' if marker else "exit 75; fi; exit 3"
  env = dict(os.environ, RUNS=str(runs), MARKER=str(flag), RESTART_DELAY_S="0")
  if marker:
    env["REFUSION_RESTART_MARKER"] = str(flag)
  script = os.path.join(REPO, "launch", "restarting.sh")
  out = subprocess.run(["bash", script, "5", "sh", "-c", body], capture_output=True, text=True, env=env, timeout=60)
  assert out.returncode == 3 and runs.read_text().count("run") == 3
  assert "restart 2 of 5" in out.stderr
  runs.unlink()
  out = subprocess.run(["bash", script, "1", "sh", "-c", body], capture_output=True, text=True, env=env, timeout=60)
  assert out.returncode == 75 and runs.read_text().count("run") == 2  # still "restart me", for an outer loop
  assert "after 1 restarts: giving up" in out.stderr


def test_restarting_runs_a_killed_command_again_and_stops_on_other_statuses(tmp_path):
  runs = tmp_path / "runs"
  # Killed by SIGKILL (137) once, then 1: one restart, then status 1, which is not restarted.
  body = 'echo run >> "$RUNS"; n=$(wc -l < "$RUNS"); if [ "$n" -lt 2 ]; then kill -9 $$; fi; exit 1'
  env = dict(os.environ, RUNS=str(runs), RESTART_DELAY_S="0")
  script = os.path.join(REPO, "launch", "restarting.sh")
  out = subprocess.run(["bash", script, "5", "sh", "-c", body], capture_output=True, text=True, env=env, timeout=60)
  assert out.returncode == 1 and runs.read_text().count("run") == 2
  assert "status 137 (this process was killed" in out.stderr and "restart 1 of 5" in out.stderr


def test_paper_table_dry_run_runs_each_task_with_its_settings(no_cloud_tools):
  env, calls = no_cloud_tools
  lines = dry_run("paper_table.sh", ["--batch_size=8", "--prompts=/src/ReFusion", "/ckpt", "out", "--limit", "5"], env)
  tasks = [line[2:] for line in lines if line.startswith("# ")]
  assert len(tasks) == 7 and tasks[0] == "gsm8k_cot" and tasks[-1] == "gpqa_main_generative_n_shot"
  for task in tasks:
    harness = command(lines, f"--tasks {task} ")
    assert harness[:3] == ["python3", "-m", "refusion_jax.harness"] and harness[-2:] == ["--limit", "5"]
    assert harness[harness.index("--model_args") + 1] == f"checkpoint=/ckpt,paper_task={task},batch_size=8"
    assert harness[harness.index("--output_path") + 1] == f"out/{task}"
    assert {"--apply_chat_template", "--log_samples", "--confirm_run_unsafe_code"} <= set(harness)
  # The official checkout's edited prompts replace lm-eval's, task by task.
  assert command(lines, "--tasks arc_challenge_chat ")[-3] == "/src/ReFusion/lm_eval/tasks/arc"
  assert not calls.exists()


def test_paper_table_on_a_pod_installs_once_then_runs_every_task_on_every_worker(no_cloud_tools):
  env, calls = no_cloud_tools
  args = ["--tasks=mbpp,mmlu_pro", "--tpu=pod", "--zone=zone-a", "--model_args=mesh=fsdp:-1", "/mnt/ckpt", "/mnt/out"]
  lines = dry_run("paper_table.sh", args, env)
  assert "'.[tpu,eval,eval-math]'" in command(lines, "pip install")[-1]  # once, before the first task
  for task in ("mbpp", "mmlu_pro"):
    remote = command(lines, "ssh", f"--tasks {task} ")
    assert "--worker=all" in remote
    harness = shlex.split(remote[-1].split("&&", 1)[1])
    assert harness[:2] == ["REFUSION_DISTRIBUTED=1", "HF_ALLOW_CODE_EVAL=1"]
    assert (
      harness[harness.index("--model_args") + 1] == f"checkpoint=/mnt/ckpt,paper_task={task},batch_size=32,mesh=fsdp:-1"
    )
  usage = subprocess.run(
    ["bash", os.path.join(REPO, "launch", "paper_table.sh"), "--tasks=gsm8k", "c", "o"], capture_output=True, text=True
  )
  assert usage.returncode == 2 and "Unknown task gsm8k" in usage.stderr
  assert not calls.exists()
