"""Chat messages to a prompt string, with the model's own chat template (from its GGUF)."""

from __future__ import annotations

from datetime import datetime
from typing import Mapping, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgespec.errors import EdgespecError

Message = Mapping[str, str]

# For models without a template (tiny test models, base models): a plain, visible format.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _raise(message: str) -> None:
    raise EdgespecError(f"the chat template refused the messages: {message}")


def render_chat(template: str | None, messages: Sequence[Message], *, bos_token: str = "",
                eos_token: str = "", add_generation_prompt: bool = True, tools: list | None = None) -> str:
    """Render messages the way the model was trained to see them; `tools` (OpenAI's function tools)
    go to the template as Hugging Face templates expect them."""
    if not messages:
        raise EdgespecError("no chat messages given")
    for m in messages:
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise EdgespecError("each chat message needs a 'role' and a 'content'")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(template or FALLBACK_TEMPLATE).render(
            messages=list(messages), bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt, **({"tools": tools} if tools else {}))
    except jinja2.TemplateError as exc:
        raise EdgespecError(f"the model's chat template failed to render: {exc}; use --raw") from exc
