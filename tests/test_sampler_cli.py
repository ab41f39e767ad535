"""The text front end (`Sampler`) and the sampling CLI on tiny saved checkpoints."""

import json

import grain
import numpy as np
import pytest
from flax import nnx
from helpers.decode_cases import byte_model

import refusion_jax as rj
from refusion_jax import sample
from refusion_jax.checkpoints import hf as hf_io
from refusion_jax.checkpoints import orbax as checkpoint
from refusion_jax.data.tokenizer import ByteTokenizer
from refusion_jax.decoding.loop import compile_count
from refusion_jax.decoding.sampler import Sampler
from refusion_jax.model import config
from refusion_jax.model import transformer as model_lib

TOK = ByteTokenizer()
METHOD = rj.ReFusion(gen_length=8, slot_size=4, serial_blocks=1, slot_threshold=0.5, token_threshold=0.5)


@pytest.fixture(scope="module")
def model():
  return byte_model(1)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, model):
  path = tmp_path_factory.mktemp("hf")
  hf_io.save_hf(model, path)
  return str(path)


def run_cli(capsys, *argv):
  code = sample.main([str(a) for a in argv])
  out, err = capsys.readouterr()
  return code, out, err


# ------------------------------------------------------------------- Sampler


def test_sampler_text_in_text_out(model):
  sampler = Sampler(model, "bytes", METHOD)
  texts, result = sampler.generate(["hello", "a longer prompt"])
  assert texts == [TOK.decode(t) for t in result.tokens]
  assert sampler("hello") == texts[0]
  assert sampler(["hello", "a longer prompt"]) == texts
  expected = rj.decode(model, [TOK.encode("hello")], METHOD, eos_id=TOK.eos_id, mask_id=TOK.mask_id)
  assert result.tokens[0] == expected.tokens[0]


def test_sampler_compiles_once_per_bucket(model):
  sampler = Sampler(model, TOK, rj.ReFusion(gen_length=12, slot_size=4, slot_threshold=0.7))  # no other test's
  before = compile_count("refusion")
  sampler(["first prompt"])
  assert compile_count("refusion") == before + 1
  sampler(["other words"])  # same bucket (16), same batch size
  assert compile_count("refusion") == before + 1


@pytest.mark.parametrize("method", [rj.AR(gen_length=6), rj.MDM(gen_length=8, block_length=4, steps=4)])
def test_sampler_decodes_the_baselines_as_decode_does(model, method):
  rng = np.random.default_rng(0)
  prompts = ["".join(chr(c) for c in rng.integers(97, 123, size=n)) for n in (3, 9)]
  _, result = Sampler(model, TOK, method=method).generate(prompts)
  direct = rj.decode(model, [TOK.encode(p) for p in prompts], method)
  assert result.tokens == direct.tokens


def test_sampler_mdm_defaults_follow_gen_length(model):
  sampler = Sampler(model, TOK, method=rj.MDM(gen_length=16))
  assert (sampler.method.block_length, sampler.method.steps) == (16, 16)


def test_sampler_chat_template_changes_the_prompt(model):
  class Bracketing(ByteTokenizer):
    def apply_chat_template(self, query):
      return f"[{query}]"

  assert Sampler(model, Bracketing(), chat_template=True).encode("hi") == TOK.encode("[hi]")


def test_sampler_refuses_a_method_name_or_loose_method_fields(model):
  """A method is a value that carries its fields: 0.3 removed 0.2's `Sampler(model, tok, method="ar", gen_length=6)`."""
  for bad in ("ar", "beam", rj.AR):
    with pytest.raises(ValueError, match=r"not a decoding method value.*refusion_jax.AR\(gen_length=64\)"):
      Sampler(model, TOK, method=bad)
  with pytest.raises(TypeError, match="gen_length"):
    Sampler(model, TOK, gen_length=6)


# ----------------------------------------------------------------------- CLI


def test_cli_json_on_a_hf_checkpoint(capsys, hf_dir, model):
  code, out, err = run_cli(
    capsys,
    "--hf_checkpoint",
    hf_dir,
    "--tokenizer",
    "bytes",
    "--prompt",
    "hello",
    "--prompt_ids",
    "5,6,7,8,9",
    "--gen_length",
    8,
    "--slot_threshold",
    0.5,
    "--token_threshold",
    0.5,
    "--json",
  )
  assert code == 0, err
  rows = [json.loads(line) for line in out.strip().splitlines()]
  assert len(rows) == 2
  expected = rj.decode(model, [TOK.encode("hello"), [5, 6, 7, 8, 9]], METHOD, eos_id=TOK.eos_id)
  for row, data in enumerate(rows):
    assert set(data) == {"tokens", "text", "num_forwards", "tpf", "seconds"}
    assert data["tokens"] == expected.tokens[row]
    assert data["text"] == TOK.decode(expected.tokens[row])
    assert data["num_forwards"] == int(expected.num_forwards[row])
    assert data["tpf"] == pytest.approx(len(data["tokens"]) / data["num_forwards"])


@pytest.mark.parametrize("method", ["ar", "mdm"])
def test_cli_baseline_methods(capsys, hf_dir, model, method):
  code, out, err = run_cli(
    capsys, "--hf_checkpoint", hf_dir, "--prompt_ids", "3,1,4", "--method", method, "--gen_length", 8, "--json"
  )
  assert code == 0, err
  value = rj.AR(gen_length=8) if method == "ar" else rj.MDM(gen_length=8, block_length=8, steps=8)
  expected = rj.decode(model, [[3, 1, 4]], value)
  assert json.loads(out)["tokens"] == expected.tokens[0]


def test_cli_trace_writes_pngs_and_prints_a_coloured_trace(capsys, tmp_path, hf_dir):
  png = tmp_path / "trace.png"
  code, out, err = run_cli(
    capsys,
    "--hf_checkpoint",
    hf_dir,
    "--tokenizer",
    "bytes",
    "--prompt",
    "ab",
    "--prompt",
    "cd",
    "--gen_length",
    8,
    "--trace",
    png,
  )
  assert code == 0, err
  for i in range(2):
    written = tmp_path / f"trace-{i}.png"
    assert written.read_bytes()[:4] == b"\x89PNG"
  assert out.count("\x1b[") > 16
  assert "TPF" in out and "answer:" in out


def test_cli_names_a_hf_checkpoint_without_a_tokenizer_and_accepts_ids(capsys, tmp_path):
  # A vocabulary larger than the byte tokenizer's: a silent byte fallback would fail on ids >= 260.
  model_config = config.tiny(vocab_size=512, mask_token_id=511, eos_token_id=510, pad_token_id=509)
  big = model_lib.init_model(model_config, seed=int(np.random.default_rng().integers(1 << 16)))
  hf_io.save_hf(big, tmp_path)
  code, out, err = run_cli(capsys, "--hf_checkpoint", tmp_path, "--prompt", "hi")
  assert code == 2 and "Traceback" not in err
  assert f"{tmp_path} has no tokenizer" in err
  assert "--tokenizer" in err and "--prompt_ids" in err

  code, out, err = run_cli(capsys, "--hf_checkpoint", tmp_path, "--prompt_ids", "300,7,450", "--method", "ar", "--json")
  assert code == 0, err
  tokens = json.loads(out)["tokens"]
  assert tokens == rj.decode(big, [[300, 7, 450]], rj.AR(gen_length=64), eos_id=510, pad_id=509).tokens[0]
  assert json.loads(out)["text"] == ",".join(map(str, tokens))


def test_cli_orbax_checkpoint(capsys, tmp_path):
  trained = byte_model(2)
  checkpoints = checkpoint.Checkpoints(str(tmp_path / "checkpoints"), async_save=False)
  checkpoints.save(
    3,
    params=nnx.state(trained),
    train={"step": 3},
    data_iterator=iter(grain.MapDataset.range(4).to_iter_dataset()),
    meta=checkpoint.model_meta(trained.config, "bytes"),
  )
  checkpoints.wait()
  checkpoints.close()
  code, out, err = run_cli(
    capsys, "--checkpoint", tmp_path, "--prompt_ids", "9,8,7", "--method", "ar", "--gen_length", 6, "--json"
  )
  assert code == 0, err
  assert json.loads(out)["tokens"] == rj.decode(trained, [[9, 8, 7]], rj.AR(gen_length=6)).tokens[0]
  code, out, err = run_cli(
    capsys,
    "--checkpoint",
    tmp_path,
    "--prompt_ids",
    "9,8,7",
    "--method",
    "ar",
    "--gen_length",
    6,
    "--json",
    "--dtype",
    "bfloat16",
  )
  assert code == 0, err
  assert 1 <= len(json.loads(out)["tokens"]) <= 6


def test_cli_random_init_demo(capsys):
  code, out, err = run_cli(capsys, "--random_init", "tiny", "--prompt", "hi", "--gen_length", 8, "--json")
  assert code == 0, err
  data = json.loads(out)
  assert 1 <= len(data["tokens"]) <= 8


@pytest.mark.parametrize(
  "argv,message",
  [
    (["--prompt", "x"], "exactly one of"),
    (["--random_init", "tiny"], "at least one --prompt"),
    (["--random_init", "tiny", "--prompt_ids", "1,two"], "comma-separated"),
    (["--random_init", "tiny", "--prompt", "x", "--gen_length", "10"], "multiple of slot_size"),
    (["--random_init", "tiny", "--prompt_ids", "1,999"], "outside the vocabulary"),
    (["--random_init", "tiny", "--prompt", "x", "--method", "beam"], "invalid choice"),
    (["--hf_checkpoint", "/nonexistent/dir", "--prompt", "x"], "not a directory"),
    (["--checkpoint", "/nonexistent/dir", "--prompt", "x"], "No checkpoint directory"),
  ],
)
def test_cli_bad_input_exits_2_with_a_message(capsys, argv, message):
  code, out, err = run_cli(capsys, *argv)
  assert code == 2
  assert message in err
  assert "Traceback" not in err
