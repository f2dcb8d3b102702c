"""Chat prompts rendered with a GGUF's Jinja chat template, sandboxed as HF transformers does."""

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> NoReturn:
    raise ValueError(f"chat template refused the messages: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers overrides jinja's tojson, which would HTML-escape and sort keys.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(
            f"chat template is not valid Jinja (line {exc.lineno}): {exc.message}"
        ) from exc


def render_chat(
    template: str,
    messages: list[dict[str, str]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """Render `messages` ({'role', 'content'} dicts) into a prompt string.

    Raises ValueError when the template does not parse, fails while rendering, or
    rejects the messages through `raise_exception`.
    """
    compiled = _compile(template)
    try:
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except ValueError:
        raise
    except Exception as exc:  # the template is untrusted code: any failure is its own
        raise ValueError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc
