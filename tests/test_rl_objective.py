"""GRPO's objective (refusion_jax.rl.objective): for the AR method the loss and its gradients are TRL's
`GRPOTrainer` loss and gradients on the same inputs; group advantages, KL estimators and bad settings."""

import numpy as np
import pytest
from helpers.extras import module_needs

pytestmark = module_needs("trl")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import safetensors.numpy  # noqa: E402
import tokenizers  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from flax import nnx  # noqa: E402
from helpers.hf_utils import save_tiny_hf_model  # noqa: E402
from helpers.torch_reference import torch  # noqa: E402

import refusion_jax as rj  # noqa: E402
from refusion_jax.checkpoints.hf import save_hf  # noqa: E402
from refusion_jax.checkpoints.load import load_model  # noqa: E402
from refusion_jax.rl.objective import GRPOConfig, grpo_loss  # noqa: E402
from refusion_jax.rl.replay import Trajectory, trajectory_logprobs  # noqa: E402

VOCAB = 211
BATCH, PROMPT, ANSWER = 4, 5, 7
TEMPERATURE = 0.7
# TRL's loss_type for each of our (tunix's) aggregation modes.
TRL_LOSS_TYPES = {"sequence-mean-token-mean": "grpo", "token-mean": "bnpo", "sequence-mean-token-scale": "dr_grpo"}


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
  vocab = {f"t{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "<eos>": VOCAB - 1}
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
  return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def _trl_trainer(model, tmp_path, loss_type: str, config: GRPOConfig) -> trl.GRPOTrainer:
  args = trl.GRPOConfig(
    output_dir=str(tmp_path / "trl"),
    loss_type=loss_type,
    beta=config.beta,
    epsilon=config.epsilon,
    epsilon_high=config.epsilon_high,
    num_generations=2,
    per_device_train_batch_size=BATCH,
    max_completion_length=ANSWER,
    temperature=TEMPERATURE,
    # TRL 1.x multiplies the KL term by the ratio by default; GRPO's (and tunix's) penalty is the plain estimate.
    use_bias_correction_kl=False,
    report_to="none",
    use_cpu=True,
    bf16=False,
  )
  prompts = Dataset.from_list([{"prompt": "t1 t2"}] * BATCH)
  return trl.GRPOTrainer(
    model=model,
    reward_funcs=lambda completions, **_: [0.0] * len(completions),
    args=args,
    train_dataset=prompts,
    processing_class=_tokenizer(),
  )


def _inputs(seed: int = 0) -> dict[str, np.ndarray]:
  """Prompts of one length, answers of different lengths (masked past their end), advantages of both signs."""
  rng = np.random.default_rng(seed)
  lengths = np.array([ANSWER, 3, 5, 1])
  completion_mask = (np.arange(ANSWER)[None] < lengths[:, None]).astype(np.int64)
  return dict(
    prompt_ids=rng.integers(0, VOCAB - 2, (BATCH, PROMPT)),
    completion_ids=np.where(completion_mask > 0, rng.integers(0, VOCAB - 2, (BATCH, ANSWER)), VOCAB - 2),
    completion_mask=completion_mask,
    advantages=rng.normal(size=BATCH).astype(np.float32),
  )


@pytest.mark.parametrize("loss_agg_mode", list(TRL_LOSS_TYPES))
def test_grpo_loss_and_gradients_for_ar_are_trls(tmp_path, loss_agg_mode):
  save_tiny_hf_model(tmp_path / "hf", "qwen3", seed=1, vocab_size=VOCAB)
  # Loaded by path, which TRL builds its reference model from.
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
  model = load_model(str(tmp_path / "hf"), format="hf")
  config = GRPOConfig(
    beta=0.04, epsilon=0.2, epsilon_high=0.28, loss_agg_mode=loss_agg_mode, max_response_length=ANSWER
  )
  inputs = _inputs()
  mask = inputs["completion_mask"].astype(np.float32)
  answer = np.where(mask > 0, inputs["completion_ids"], -1).astype(np.int32)
  prompt = jnp.asarray(inputs["prompt_ids"], jnp.int32)
  prompt_len = jnp.full((BATCH,), PROMPT, jnp.int32)
  graphdef, params = nnx.split(model)

  trajectory = Trajectory(jnp.asarray(answer), jnp.where(answer >= 0, jnp.arange(ANSWER), -1))
  method = rj.AR(gen_length=ANSWER, temperature=TEMPERATURE)

  def logprobs_of(params):  # the replay of the AR answers: what GRPO's update differentiates
    model = nnx.merge(graphdef, params)
    return trajectory_logprobs(model, prompt, prompt_len, trajectory, method, temperature=TEMPERATURE, chunk=4)

  # The old and reference policies a little off the current one, so that ratios leave the clip range both ways.
  current = np.asarray(logprobs_of(params))
  rng = np.random.default_rng(1)
  old = (current + rng.normal(0.0, 0.3, current.shape)).astype(np.float32)
  ref = (current + rng.normal(0.0, 0.5, current.shape)).astype(np.float32)

  def loss_of(params):
    return grpo_loss(logprobs_of(params), old, inputs["advantages"], mask, config, ref_logprobs=ref)

  (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
  assert 0.0 < float(metrics["clip_fraction"]) < 1.0  # both branches of the clip are exercised

  trainer = _trl_trainer(hf_model, tmp_path, TRL_LOSS_TYPES[loss_agg_mode], config)
  torch_model = trainer.model.eval()
  torch_model.zero_grad()
  tensor = lambda x, dtype=torch.long: torch.tensor(np.asarray(x), dtype=dtype)
  trl_loss = trainer._compute_loss(
    torch_model,
    dict(
      prompt_ids=tensor(inputs["prompt_ids"]),
      prompt_mask=torch.ones(BATCH, PROMPT, dtype=torch.long),
      completion_ids=tensor(inputs["completion_ids"]),
      completion_mask=tensor(inputs["completion_mask"]),
      advantages=tensor(inputs["advantages"], torch.float32),
      # Ours are NaN where nothing was committed (the replay's); TRL's are any finite number there.
      old_per_token_logps=tensor(np.nan_to_num(old), torch.float32),
      ref_per_token_logps=tensor(np.nan_to_num(ref), torch.float32),
    ),
  )
  trl_loss.backward()
  trl_loss = trl_loss.detach()
  np.testing.assert_allclose(float(loss), trl_loss.item(), rtol=1e-5, atol=1e-6)

  # Our gradients written as a Hugging Face checkpoint: TRL's parameter names and layouts, for each gradient.
  save_hf(nnx.merge(graphdef, grads), tmp_path / "grads")
  ours = safetensors.numpy.load_file(tmp_path / "grads" / "model.safetensors")
  theirs = {name: p.grad.numpy() for name, p in torch_model.named_parameters() if p.grad is not None}
  assert set(theirs) == set(ours)
  scale = max(np.abs(g).max() for g in theirs.values())
  for name, grad in theirs.items():
    np.testing.assert_allclose(ours[name], grad, atol=2e-5 * scale, rtol=0, err_msg=name)
