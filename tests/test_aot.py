"""Activation sharding and the ahead-of-time report, on 8 fake CPU devices (and a TPU topology when libtpu is here)."""

import json
import os
import re
import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.fake_devices import run_json
from jax.sharding import NamedSharding, PartitionSpec

from refusion_jax.model.config import tiny
from refusion_jax.parallel import compiled
from refusion_jax.parallel.activations import activation_sharding, constrain
from refusion_jax.parallel.sharding import check_batch_split, make_mesh
from refusion_jax.training.aot_report import train_advice, train_report
from refusion_jax.training.config_file import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = ["--config", "configs/demo.py:smoke", "--config.model.num_kv_heads=2"]


def run_python(args, devices: int = 8, timeout: int = 600) -> subprocess.CompletedProcess:
  env = dict(
    os.environ,
    PYTHONPATH=REPO,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
  )
  return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)


# Per-device memory of the same global step as chips are added, and the step's numbers with the constraints on.
_SCALING = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    import numpy as np
    from refusion_jax.training import aot_report
    from refusion_jax.parallel import compiled, sharding
    from refusion_jax.parallel.activations import sharded_activations
    from refusion_jax.training import state as train
    from refusion_jax.training.run_config import objective_config_from
    from refusion_jax.training.config_file import load_config
    from refusion_jax.model.transformer import abstract_model

    config = load_config("configs/demo.py", "smoke")
    config.model.update(vocab_size=1024, num_kv_heads=2, remat="full")
    config.data.seq_len, config.batch_size = 128, 16
    temporaries = {}
    for ways in (2, 8):
      config.mesh.update(data=1, fsdp=ways, tensor=1)
      temporaries[ways] = aot_report.train_report(config, jax.devices()[:ways], None).temporaries

    config.data.seq_len, config.batch_size, config.grad_accum_steps = 32, 8, 2
    model_config = aot_report.model_config_of(config)
    tx, schedule = train.make_optimizer(config.optimizer, total_steps=10)
    objective = objective_config_from(config, model_config)
    graphdef, _ = abstract_model(model_config)
    rng = np.random.default_rng(int(sys.argv[1]))
    prompt_len = rng.integers(1, 10, 8)
    answer_len = rng.integers(1, 32 - prompt_len + 1)
    batch = dict(tokens=rng.integers(0, 256, (8, 32)).astype(np.int32), prompt_len=prompt_len.astype(np.int32),
                 answer_len=answer_len.astype(np.int32))

    def losses(mesh_shape, devices):
      mesh = sharding.make_mesh(mesh_shape, devices)
      init = train.init_state_fn(model_config, tx, seed=0)
      placement = train.make_placement(init, mesh, sharding.LOGICAL_AXIS_RULES)
      state = jax.jit(init, out_shardings=placement.state_shardings)()
      fn = train.make_train_step(graphdef, tx, schedule, objective, config.grad_accum_steps)
      step = placement.jit_step(sharded_activations(fn, mesh))
      out = []
      for _ in range(2):
        state, metrics = step(state, placement.batch(batch))
        out.append(float(metrics["loss"]))
      return out

    print(json.dumps(dict(
      temporaries=temporaries,
      single=losses({"data": 1}, jax.devices()[:1]),
      sharded=losses({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices()),
    )))
""")


def test_memory_per_device_falls_as_devices_are_added_and_losses_stay():
  seed = int(np.random.default_rng().integers(1 << 16))
  out = run_python(["-c", _SCALING, str(seed)])
  assert out.returncode == 0, out.stderr[-3000:]
  report = json.loads(out.stdout.strip().splitlines()[-1])
  temporaries = {int(k): v for k, v in report["temporaries"].items()}
  # 4x the devices for the same global batch: activations split 4x finer (without the
  # constraints the step kept ~70% of its temporaries per device).
  assert temporaries[8] < 0.4 * temporaries[2], temporaries
  np.testing.assert_allclose(report["sharded"], report["single"], rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")


def test_aot_cli_reports_memory_and_exits_1_saying_what_does_not_fit():
  # 2 MB per device: the smoke training step (1 MB) fits, the decode batch of 8 (3.2 MB) does not.
  mesh = ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]
  out = run_python(["-m", "refusion_jax.aot", *SMOKE, *mesh, "--decode_batch=8", "--hbm_gib=0.002"])
  assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
  lines = out.stdout.splitlines()
  train_row = next(line for line in lines if line.startswith("| train step, batch 8 x 64, grad_accum 1"))
  assert "mesh data:2+fsdp:2+tensor:2 | 8 |" in train_row and "| yes |" in train_row
  assert any(line.startswith("| decode (prefill + 1 loop iteration), batch 8") and "| NO |" in line for line in lines)
  assert "DOES NOT FIT: decode" in out.stdout and "--decode_mesh=tensor:N" in out.stdout
  times = next(line for line in lines if line.startswith("Compile times on this host: "))
  assert re.search(r"train step, batch 8 x 64, [^;]*: \d+ s; decode", times), times


# The training step at each remat policy, on the smoke config's 8-device mesh.
_REMAT = textwrap.dedent("""
    import json, sys
    import jax
    from refusion_jax.training.aot_report import train_reports
    from refusion_jax.training.config_file import load_config

    config = load_config("configs/demo.py", "smoke")
    config.model.num_kv_heads = 2
    reports = train_reports(config, jax.devices(), None, sys.argv[1].split(","))
    print(json.dumps({r.name: dict(temporaries=r.temporaries, total=r.total, flops=r.flops) for r in reports}))
""")


def test_aot_compiles_the_train_step_once_per_remat_policy():
  policies = ["none", "projections", "full"]
  reports = run_json(_REMAT, ",".join(policies))
  rows = {policy: report for policy in policies for name, report in reports.items() if f"remat {policy}," in name}
  assert sorted(rows) == sorted(policies) and len(reports) == 3, reports
  assert all(row["temporaries"] > 0 and row["total"] > row["temporaries"] for row in rows.values()), rows
  # Keeping less costs recomputation: more FLOPs, and fewer temporaries.
  assert rows["none"]["flops"] < rows["projections"]["flops"] < rows["full"]["flops"], rows
  assert rows["none"]["temporaries"] > rows["full"]["temporaries"], rows


def test_decode_report_pads_a_batch_smaller_than_the_mesh_and_names_the_mesh():
  # 3 prompts on the smoke config's 8-way data mesh: the cache's rows cannot split 8 ways until padded to 8.
  out = run_python(["-m", "refusion_jax.aot", *SMOKE, "--programs=decode", "--decode_batch=3", "--hbm_gib=1"])
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  assert "Decode mesh data:8 (config.mesh; --decode_mesh=... to choose another)" in out.stdout
  rows = [line for line in out.stdout.splitlines() if line.startswith("| decode")]
  assert rows and all("batch 3 as 8 rows (a multiple of 8 batch-parallel devices)" in row for row in rows), rows
  assert all("mesh data:8 | 8 |" in row and "| yes |" in row for row in rows), rows


def test_train_advice_names_the_knobs():
  config = load_config(os.path.join(REPO, "configs/demo.py"))
  config.batch_size, config.grad_accum_steps, config.data.seq_len = 64, 1, 4096
  chip = compiled.Chip("test", 10e9, 1e12, 1e11)
  report = compiled.Report("train", 8, chip, arguments=2e9, outputs=2e9, aliased=2e9, temporaries=30e9)
  advice = " ".join(train_advice(report, config, tiny(attention_impl="xla"), ways=8))
  assert "remat=full" in advice and "attention_impl=auto" in advice and "chunked" in advice
  assert "attention_impl" not in " ".join(train_advice(report, config, tiny(remat="full"), ways=8))
  # 30 GB of activations into the 7 GB left after the state: 5 microbatches, rounded to a divisor of 8 rows.
  assert "grad_accum_steps to 8" in advice
  assert (
    train_advice(compiled.Report("train", 8, chip, arguments=1, outputs=1, aliased=1, temporaries=1), config, tiny(), 8)
    == []
  )
  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  with pytest.raises(ValueError, match="grad_accum_steps=3"):
    check_batch_split(64, 3, mesh)


def test_roofline_times_compute_on_at_least_the_model_flops():
  chip = compiled.Chip("test", 10e9, 1e12, 1e11)  # 1 TFLOP/s, 100 GB/s
  counted = compiled.Report("t", 1, chip, flops=3e12, bytes_accessed=1e9, model_flops=2e12, loop_count=2)
  assert counted.estimated_seconds == pytest.approx(6.0) and counted.estimated_mfu == pytest.approx(2 / 6)
  # A compiler count below the model's (a scanned loss counted once, a custom kernel not at all) cannot give MFU > 1.
  undercounted = compiled.Report("t", 1, chip, flops=1e12, bytes_accessed=1e9, model_flops=5e12)
  assert undercounted.estimated_seconds == pytest.approx(5.0) and undercounted.estimated_mfu == pytest.approx(1.0)
  memory_bound = compiled.Report("t", 1, chip, flops=1e12, bytes_accessed=1e12, model_flops=1e12)
  assert memory_bound.estimated_seconds == pytest.approx(10.0) and memory_bound.estimated_mfu == pytest.approx(0.1)

  # Layers scanned: no compiler counts, so compute time on the traced count (and the model's, if larger).
  traced = compiled.Report("t", 1, chip, traced_flops=4e12, model_flops=2e12, loop_count=2)
  assert traced.estimated_seconds == pytest.approx(4.0) and traced.estimated_mfu == pytest.approx(0.5)


def test_matmul_flops_count_loops_at_their_trip_count_and_the_costliest_branch():
  def program(x, w, b):
    y = jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]  # 8 x [16,32]@[32,32]
    z = jnp.einsum("bij,bjk->bik", b, b)  # batched: 3 x [4,4]@[4,4]
    return jax.lax.cond(y.sum() > 0, lambda: y @ w[0] @ w[1], lambda: y @ w[0]) + z.sum()

  rng = np.random.default_rng(0)
  x, w, b = (rng.normal(size=s).astype(np.float32) for s in ((16, 32), (8, 32, 32), (3, 4, 4)))
  expected = 2 * (8 * 16 * 32 * 32 + 3 * 4 * 4 * 4 + 2 * 16 * 32 * 32)
  assert compiled.matmul_flops(jax.make_jaxpr(program)(x, w, b)) == expected


def test_traced_flops_see_every_scanned_layer_and_the_recomputation():
  # XLA's cost analysis counts a scanned layer once; the trace counts all of them, as unrolled.
  config = load_config("configs/demo.py", "smoke")
  config.model.update(vocab_size=1024, num_kv_heads=2, attention_impl="xla")
  config.data.seq_len, config.batch_size = 64, 4
  config.mesh.update(data=1, fsdp=1, tensor=1)
  reports = {}
  for scan, remat in ((False, "none"), (False, "full"), (True, "full")):
    config.model.update(scan_layers=scan, remat=remat)
    reports[scan, remat] = train_report(config, jax.devices()[:1], None)
  unrolled, scanned, no_remat = reports[False, "full"], reports[True, "full"], reports[False, "none"]
  assert scanned.flops is None and scanned.traced_flops == unrolled.traced_flops
  # Only the matrix products: the compiler adds norms, softmax and activations on top.
  assert 0.85 * unrolled.flops < unrolled.traced_flops < unrolled.flops
  # Full remat recomputes each layer's forward in the backward pass: 6 -> 8 FLOPs per weight per token.
  assert no_remat.model_flops < no_remat.traced_flops < unrolled.traced_flops < 1.4 * no_remat.traced_flops


def test_out_of_memory_compile_becomes_a_report_that_does_not_fit():
  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  state = jax.ShapeDtypeStruct((1000, 250), np.float32, sharding=NamedSharding(mesh, PartitionSpec()))
  message = (
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (128.00G) "
    "exceeds available HBM (95.74G)."
  )

  def lower():
    raise RuntimeError(message)

  report = compiled.compile_report("step", lower, (state,), list(mesh.devices.flat), compiled.CHIPS["TPU v5"])
  assert report.fits is False and report.arguments == 1_000_000
  assert report.total == 1_000_000 + 128 * compiled.GIB
  assert "| 0.001 | – | >= 137 | >= 137 | 103 | NO |" in compiled.format_table([report])


def test_constraints_are_the_identity_without_a_mesh_and_skip_axes_that_do_not_divide():
  x = np.arange(6.0).reshape(1, 6)
  assert constrain(x, ("activation_batch", "activation_vocab")) is x
  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  with activation_sharding(mesh):
    y = jax.jit(lambda x: constrain(x, ("activation_batch", "activation_vocab")))(x)
    with pytest.raises(ValueError, match="2 logical axes"):
      constrain(x[0], ("activation_batch", "activation_vocab"))
  np.testing.assert_array_equal(y, x)


@pytest.mark.extra("tpu")
def test_compiles_for_a_tpu_topology():
  out = run_python(["-m", "refusion_jax.aot", *SMOKE, "--topology=v5p:2x2x1", "--decode_batch=4"], devices=1)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  assert "4 devices (TPU v5)" in out.stdout
  rows = [line for line in out.stdout.splitlines() if line.startswith(("| train step", "| decode"))]
  # v5p's 95.74 GiB = 103 GB; on a TPU the roofline estimate is filled in, and the training step's MFU estimate.
  assert len(rows) >= 2 and all("| 103 | yes |" in row and row.split("|")[-3].strip() != "–" for row in rows), rows
  train_mfu = [float(row.split("|")[-2].strip(" %")) for row in rows if row.startswith("| train step")]
  assert train_mfu and all(0 < mfu <= 100 for mfu in train_mfu), rows


@pytest.mark.extra("tpu")
def test_a_batched_refusion_decode_at_the_papers_block_compiles_for_one_v5e_chip():
  # Row picks at a block of 128 (G = 512, S = 8, 4 blocks) abort XLA's TPU compiler (a failed check in its gather
  # emitter, which kills the process): the decoder must not pick rows on a TPU.
  paper_block = ["--config.eval.gen_length=512", "--config.eval.slot_size=8", "--config.eval.serial_blocks=4"]
  one_chip = ["--topology=v5e:2x2", "--config.mesh.fsdp=1", "--config.mesh.data=1", "--decode_mesh=data:1"]
  out = run_python(
    ["-m", "refusion_jax.aot", *SMOKE, *one_chip, *paper_block, "--programs=decode", "--decode_batch=8"], devices=1
  )
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  assert any(line.startswith("| decode") and "batch 8" in line for line in out.stdout.splitlines()), out.stdout


def test_rows_are_never_picked_on_a_tpu(monkeypatch):
  from refusion_jax.decoding import mesh

  assert mesh.pick_rows_on(None)  # this CPU
  monkeypatch.setattr(mesh, "default_device", lambda: types.SimpleNamespace(platform="tpu"))
  assert not mesh.pick_rows_on(None)
