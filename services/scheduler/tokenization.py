"""Prompt tokenization in the scheduler, torch-free: `tokenizers` over the model directory's
tokenizer.json, the chat template (tokenizer_config.json's `chat_template` or
chat_template.jinja) rendered with jinja2, and the model facts the scheduler validates against
(vocab size, max model length) from config.json.

`encode(text)` is `Tokenizer.encode(text).ids` (the tokenizer's own post-processor decides about
special tokens); a chat prompt is rendered as one user message with the generation prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelFacts:
    name: str
    vocab_size: int
    max_model_len: int


def read_model_facts(model_dir: Path) -> ModelFacts:
    """Reads config.json; raises ValueError naming the file when it is missing or incomplete."""
    path = model_dir / "config.json"
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read model config: {e}") from None
    if "vocab_size" not in raw:
        raise ValueError(f"{path}: no vocab_size")
    max_len = int(raw.get("max_position_embeddings") or raw.get("max_seq_len") or 0)
    if max_len < 1:
        raise ValueError(f"{path}: no max_position_embeddings")
    return ModelFacts(model_dir.name, int(raw["vocab_size"]), max_len)


class PromptTokenizer:
    """Encodes prompts and renders the chat template (see the module docstring)."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{model_dir}: no tokenizer.json")
        self._tokenizer = Tokenizer.from_file(str(path))
        self._config: dict[str, Any] = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.is_file():
            self._config = json.loads(config_path.read_text())
        template = self._config.get("chat_template")
        jinja_path = model_dir / "chat_template.jinja"
        if not isinstance(template, str) and jinja_path.is_file():
            template = jinja_path.read_text()
        self._template = self._compile(template) if isinstance(template, str) else None

    @staticmethod
    def _compile(source: str) -> Any:
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(source)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=False))

    def render_chat(self, text: str) -> str:
        """The chat template applied to one user message, ending with the assistant prompt."""
        return self.render_messages([{"role": "user", "content": text}])

    def render_messages(self, messages: list[dict[str, str]]) -> str:
        """The chat template applied to `messages` ({role, content}), ending with the assistant
        prompt; ValueError when the model has no template or the template refuses them."""
        if self._template is None:
            raise ValueError("the model has no chat template; send the prompt without chat")
        import jinja2

        try:
            return str(self._template.render(messages=messages, add_generation_prompt=True,
                                             bos_token=self._config.get("bos_token", ""),
                                             eos_token=self._config.get("eos_token", "")))
        except jinja2.TemplateError as e:
            raise ValueError(f"the model's chat template refused the messages: {e}") from None

    def encode_chat(self, text: str) -> list[int]:
        return self.encode(self.render_chat(text))
