"""Every preset takes every `ModelConfig` field as an override."""

import dataclasses

import pytest

from refusion_jax.model.config import PRESETS, ModelConfig, preset

FIELDS = [field.name for field in dataclasses.fields(ModelConfig)]


def another_value(config: ModelConfig, field: str):
  """A valid value of `field` that differs from the preset's."""
  current = getattr(config, field)
  chosen = {
    "num_heads": config.num_kv_heads * 3,
    "num_kv_heads": 1,
    "architecture": "llama" if current != "llama" else "qwen2",
    "rope_scaling": "llama3",
    "dtype": "bfloat16",
    "param_dtype": "bfloat16",
    "remat": "projections",
    "attention_impl": "chunked",
    "quantize": "int8",
  }
  if field in chosen:
    return chosen[field]
  if isinstance(current, bool):
    return not current
  if current is None:
    return 7
  return current + 3 if isinstance(current, int) else current * 2 + 1


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_field_overrides_every_preset(name):
  base = preset(name)
  for field in FIELDS:
    value = another_value(base, field)
    assert value != getattr(base, field), field
    config = preset(name, **{field: value})
    assert getattr(config, field) == value, (name, field)
    if (name, field) != ("tiny", "architecture"):  # tiny's family switches follow its architecture
      assert config == base.replace(**{field: value}), (name, field)


def test_the_shapes_of_a_shrunk_recipe_model_are_the_overrides():
  config = preset("qwen3_8b", num_layers=8, vocab_size=1024, hidden_size=256, num_heads=4, num_kv_heads=2)
  assert (config.num_layers, config.vocab_size, config.hidden_size, config.num_heads) == (8, 1024, 256, 4)
  assert preset("refusion_8b").vocab_size == 151_671 and preset("refusion_8b", vocab_size=300).vocab_size == 300


def test_an_unknown_field_is_named_with_the_fields_a_preset_takes():
  with pytest.raises(ValueError, match=r"Unknown ModelConfig fields \['layers'\].*num_layers"):
    preset("qwen3_8b", layers=8)
