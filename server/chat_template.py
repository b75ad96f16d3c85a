"""The chat template: the checkpoint's own (a Jinja template, as transformers applies it), or a
stated fallback when it has none.

The checkpoint's template comes from `chat_template.jinja` or `tokenizer_config.json`'s
"chat_template" (a string, or a list of named templates of which "default" is used), rendered in
Jinja's immutable sandbox (templates come with downloaded checkpoints and are untrusted) with
messages, add_generation_prompt, bos_token and eos_token, as transformers renders them.

FALLBACK_TEMPLATE, for checkpoints without one (the shipped sample model is a code model with no
chat tokens), is plain text: every message becomes `<|{role}|>\\n{content}\\n`, in order, then
`<|assistant|>\\n`, where the reply begins. It is served as a Jinja template too (/tokenizer_info),
so a client that renders chats itself (lm-evaluation-harness) renders them the same way.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

FALLBACK_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
                     "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


class ChatTemplateError(ValueError):
    """A checkpoint's template that cannot be read or compiled, or a chat it refuses."""


class ChatTemplate:
    def __init__(self, source: str, origin: str, special_tokens: dict[str, str | None]):
        """origin: where the template came from, as said to users ("tokenizer_config.json", "fallback")."""
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source, self.origin, self.special_tokens = source, origin, special_tokens
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat_template ({origin}): does not compile ({_first_line(exc)})") from None

    @property
    def is_fallback(self) -> bool:
        return self.origin == "fallback"

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **{k: v for k, v in self.special_tokens.items() if v is not None})
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"messages: the chat template ({self.origin}) refused them: {_first_line(exc)}") \
                from None
        except Exception as exc:  # noqa: BLE001 - a checkpoint's template is code that may fail on any input
            raise ChatTemplateError(f"messages: the chat template ({self.origin}) failed on them: "
                                    f"{type(exc).__name__}: {_first_line(exc)}") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate:
        model_dir = Path(model_dir)
        config = _tokenizer_config(model_dir)
        special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(jinja_file.read_text(encoding="utf-8"), "chat_template.jinja", special)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is None:
            return cls(FALLBACK_TEMPLATE, "fallback", special)
        if not isinstance(template, str):
            raise ChatTemplateError("tokenizer_config.json: chat_template must be a string or a list of named templates")
        return cls(template, "tokenizer_config.json", special)


def _tokenizer_config(model_dir: Path) -> dict:
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise ChatTemplateError("tokenizer_config.json: not valid JSON") from None
    return config if isinstance(config, dict) else {}


def _token_text(value) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise(message):
    import jinja2
    raise jinja2.TemplateError(message)


def _first_line(exc: Exception) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]
