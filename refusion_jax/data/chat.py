"""Whole chats rendered by a Hugging Face Jinja chat template, as transformers' `apply_chat_template` renders
them, without transformers: what the lm-eval harness (`refusion_jax.evaluation.harness`) and the server's
chat endpoint (`refusion_jax.serving`) show the model.

`Tokenizer.apply_chat_template` wraps one query, the way training data were
formatted; a benchmark's prompt may hold a system message, few-shot turns and
an assistant turn already begun, which only the checkpoint's own template
(`HFTokenizer.chat_template`) renders as the model expects. jinja2 comes with
the `eval` and `serve` extras; it is imported only here, when a template is
first compiled (`compiled_template`, once per template).
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from refusion_jax.data.tokenizer import HFTokenizer, Tokenizer

# transformers' marker for continuing the final message: appended to it, the rendered chat is cut where it is.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@functools.lru_cache(maxsize=8)
def compiled_template(template: str) -> Any:
  """`template` compiled once in jinja2's immutable sandbox with transformers' globals and filters (a server
  renders every chat with one template: compiling it per request cost more than rendering)."""
  import jinja2
  import jinja2.ext
  import jinja2.sandbox

  def raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter: jinja's own escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(template)


def render_chat(
  template: str,
  messages: Sequence[Mapping[str, str]],
  add_generation_prompt: bool = True,
  enable_thinking: bool = True,
  **special_tokens: str,
) -> str:
  """The chat as `template` renders it; `add_generation_prompt=False` continues the final (assistant) message
  instead (transformers' `continue_final_message`): the text ends where that message's content ends.

  Args:
    template: the Jinja chat template (tokenizer_config.json's `chat_template`).
    messages: [{"role": ..., "content": ...}, ...].
    enable_thinking: passed to the template (Qwen3's: False adds an empty think block).
    special_tokens: spellings the template may use (bos_token, eos_token).
  """
  messages = [dict(m) for m in messages]
  if not add_generation_prompt:
    messages[-1]["content"] += _CONTINUE_TAG
  text = compiled_template(template).render(
    messages=messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking, **special_tokens
  )
  if add_generation_prompt:
    return text
  if _CONTINUE_TAG.strip() not in text:
    raise ValueError("The chat template drops the final message, so its assistant turn cannot be continued.")
  at = text.rindex(_CONTINUE_TAG.strip())
  # A template that strips the message also strips the tag's space; then trailing spaces go as well.
  return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def render_messages(
  tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
) -> str:
  """The chat as the checkpoint's template renders it (`render_chat`, thinking on), the tokenizer's special
  tokens spelled as the template expects; without `add_generation_prompt` the final (assistant) message is
  continued.

  A tokenizer without a Jinja template (the byte tokenizer) wraps each user turn with its own
  `apply_chat_template` and appends every other message's content.
  """
  template = getattr(tokenizer, "chat_template", None)
  if template:
    names = {}
    if isinstance(tokenizer, HFTokenizer):
      names = dict(bos_token=tokenizer.token_text(tokenizer.bos_id), eos_token=tokenizer.token_text(tokenizer.eos_id))
    return render_chat(template, messages, add_generation_prompt, **names)
  return "".join(tokenizer.apply_chat_template(m["content"]) if m["role"] == "user" else m["content"] for m in messages)
