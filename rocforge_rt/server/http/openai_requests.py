"""OpenAI request bodies, checked, as the daemon's `generate` op.

`chat_request` and `completion_request` read a decoded JSON body and return a
`Generation`: the fields of one `generate` (a one-shot turn: the daemon opens a session for
it and closes it at the end) and how its replies are to be shaped. Every refusal is an
`ApiError` (400) naming the field. Fields this front does not know are ignored, as
OpenAI-compatible servers do; fields it knows but cannot honour (`tools`, `logit_bias`,
...) are accepted at their default and refused otherwise, by name, so a client never gets
silently different output than it asked for.

Sampling: OpenAI's `temperature`, `top_p`, `seed`, `presence_penalty` and
`frequency_penalty` (-2 to 2), and the extensions llama.cpp's and vLLM's servers take,
`top_k`, `min_p` (0 to 1) and `repetition_penalty` (> 0). The penalties are llama.cpp's,
over the last 64 tokens of the context, prompt included (step/sampling.py has the rules).
Defaults follow the OpenAI API reference: `temperature` 1, `top_p` 1, no penalty,
`/v1/completions`' `max_tokens` 16; a chat completion without `max_tokens` may run to the
daemon's `--max-new-tokens`.
"""

import math
from dataclasses import dataclass
from typing import Any

from rocforge_rt.server.fields import (
    MAX_MESSAGES,
    MAX_ROLE_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    is_token_id,
)
from rocforge_rt.server.http.errors import bad_field
from rocforge_rt.server.protocol import MAX_TOKENS_FIELD
from rocforge_rt.step.sampling import (
    FLOAT32_TINY,
    INT32_MAX,
    MAX_LOGPROBS,
    SAMPLING_BOUNDS,
    SEED_MAX,
    Bounds,
)

OPENAI_MAX_TEMPERATURE = 2.0  # OpenAI's range (the daemon's reaches further)
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE = 1.0
ROLES = {  # OpenAI's role -> the chat template's
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


@dataclass(frozen=True)
class Generation:
    """One generation: the `generate` op's fields, and how the reply is shaped."""

    model: str
    fields: dict[str, Any]  # prompt/tokens/messages, sampling, stop, logprobs
    prompt_field: str  # `messages` or `prompt`: the field a too-long prompt is blamed on
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None: not asked for; else how many alternatives a token
    max_tokens: int | None = None  # the client's (None: not given)
    max_tokens_field: str = "max_tokens"  # the field it came in
    default_max_tokens: int | None = None  # when not given (None: the daemon's limit)

    def generate_fields(self, max_new_tokens: int) -> dict[str, Any]:
        """The `generate` op's fields, for a daemon that allows `max_new_tokens` a turn (400
        when the client asked for more; a default is cut to it)."""
        max_tokens = self.max_tokens
        if max_tokens is not None and max_tokens > max_new_tokens:
            raise bad_field(
                self.max_tokens_field,
                f"'{self.max_tokens_field}' {max_tokens} is over this server's limit of"
                f" {max_new_tokens} (the daemon's --max-new-tokens)",
            )
        if max_tokens is None and self.default_max_tokens is not None:
            max_tokens = min(self.default_max_tokens, max_new_tokens)
        return {**self.fields, "max_tokens": max_tokens}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _number(body: dict[str, Any], name: str, lo: float, hi: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or not lo <= value <= hi:
        raise bad_field(name, f"'{name}' must be a number from {lo:g} to {hi:g}, got {value!r}")
    return float(value)


def _integer(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise bad_field(name, f"'{name}' must be an integer from {lo} to {hi}, got {value!r}")
    return value


def _boolean(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_field(name, f"'{name}' must be true or false, got {value!r}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _common(body: Any, prompt_field: str) -> dict[str, Any]:
    """What chat and text completions share: model, sampling, stop, n, stream, penalties."""
    if not isinstance(body, dict):
        raise bad_field(None, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_field("model", "'model' is required: a string naming the model (GET /v1/models)")
    n = body.get("n")
    if n is not None and (n != 1 or isinstance(n, bool)):
        raise bad_field("n", f"'n' must be 1 (one choice a request), got {_short(n)}")
    _refuse_unsupported(body)
    temperature = _number(body, "temperature", 0.0, OPENAI_MAX_TEMPERATURE, DEFAULT_TEMPERATURE)
    temperature = _flushed(temperature, SAMPLING_BOUNDS["temperature"])  # a tiny one: greedy
    top_p = _number(body, "top_p", 0.0, SAMPLING_BOUNDS["top_p"].hi, 1.0)
    top_k = _integer(body, "top_k", -1, INT32_MAX)  # an extension (vLLM's): -1 or 0 is off
    seed = _integer(body, "seed", -(1 << 63), SEED_MAX)
    fields: dict[str, Any] = {
        "temperature": temperature,
        "top_p": max(top_p, FLOAT32_TINY),  # 0: only the most likely token, as the tiniest
        "top_k": max(top_k, 0) if top_k is not None else None,
        "seed": None if seed is None else seed % (SEED_MAX + 1),  # a negative seed: its 64 bits
        **_penalties(body),
        "stop": _stop(body.get("stop")),
    }
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_field("stream_options", "'stream_options' must be an object")
    include_usage = stream and _boolean(options or {}, "include_usage")
    return {
        "model": model,
        "fields": fields,
        "prompt_field": prompt_field,
        "stream": stream,
        "include_usage": include_usage,
    }


def _flushed(value: Any, bounds: Bounds) -> Any:
    """A number nearer 0 than float32's smallest normal is 0, as on the device (a negative one
    only where `bounds` take negative numbers)."""
    if _is_number(value) and abs(value) < FLOAT32_TINY and (bounds.signed or value >= 0):
        return 0.0
    return value


def _penalties(body: dict[str, Any]) -> dict[str, float | None]:
    """`min_p` and the three penalties as the `generate` fields (None: not given, the daemon's
    default: no effect), flushed (`_flushed`) and checked by the daemon's own bounds
    (step/sampling.py), a refusal phrased as OpenAI's ranges are."""
    fields: dict[str, float | None] = {}
    for name in ("min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        value = body.get(name)
        bounds = SAMPLING_BOUNDS[name]
        held = None if value is None else bounds.admit(_flushed(value, bounds))
        if value is not None and held is None:
            raise bad_field(name, f"{_range_of(name, bounds)}, got {_short(value)}")
        fields[name] = held
    return fields


def _range_of(name: str, bounds: Bounds) -> str:
    if name == "repetition_penalty":  # the device divides by it
        return (
            f"'{name}' must be a number > 0 (1: none; a float32 from {bounds.lo:g} to"
            f" {bounds.hi:g})"
        )
    return f"'{name}' must be a number from {-bounds.hi if bounds.signed else 0:g} to {bounds.hi:g}"


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """Known OpenAI fields this front cannot honour: accepted only at their default."""
    checks = {
        "tools": lambda v: not v,
        "functions": lambda v: not v,
        "tool_choice": lambda v: v in ("none", "auto"),
        "function_call": lambda v: v in ("none", "auto"),
        "logit_bias": lambda v: not v,
        "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text",
        "echo": lambda v: v is False,
        "suffix": lambda v: v == "",
        "best_of": lambda v: v == 1 and not isinstance(v, bool),
    }
    for name, default in checks.items():
        value = body.get(name)
        if value is not None and not default(value):
            raise bad_field(name, f"'{name}' is not supported by this server ({_short(value)})")


def _stop(value: Any) -> list[str] | None:
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise bad_field(
            "stop",
            f"'stop' must be a string or a list of up to {MAX_STOP_STRINGS} strings of 1 to"
            f" {MAX_STOP_CHARS} characters",
        )
    return stops or None


def _max_tokens(body: dict[str, Any]) -> dict[str, Any]:
    """`max_completion_tokens` (the newer name) or `max_tokens`, and which one it was."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = _integer(body, name, 1, MAX_TOKENS_FIELD)
        if value is not None:
            return {"max_tokens": value, "max_tokens_field": name}
    return {}


def chat_request(body: Any) -> Generation:
    """A `/v1/chat/completions` body: `messages` rendered by the daemon's chat template."""
    common = _common(body, "messages")
    logprobs = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not logprobs:
        raise bad_field("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    asked = (top or 0) if logprobs else None
    fields = {
        **common.pop("fields"),
        "messages": _messages(body.get("messages")),
        # the daemon sends token bytes with logprobs of 1 or more: ask for one at least
        "logprobs": None if asked is None else max(asked, 1),
    }
    return Generation(**common, fields=fields, logprobs=asked, **_max_tokens(body))


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_MESSAGES:
        raise bad_field("messages", f"'messages' must be a list of 1 to {MAX_MESSAGES} messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_field(where, f"'{where}' must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            shown = _short(role)[:MAX_ROLE_CHARS]
            raise bad_field(
                f"{where}.role", f"'{where}.role' must be one of {', '.join(ROLES)}, got {shown}"
            )
        out.append({"role": ROLES[role], "content": _content(message.get("content"), where)})
    return out


def _content(value: Any, where: str) -> str:
    """A message's text: a string, text parts (joined by newlines), or null (empty)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise bad_field(
                    f"{where}.content[{j}]",
                    f"'{where}.content[{j}]': only text parts are supported"
                    " ({'type': 'text', 'text': ...})",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_field(f"{where}.content", f"'{where}.content' must be a string or a list of parts")


def completion_request(body: Any) -> Generation:
    """A `/v1/completions` body: `prompt` a string or a list of token ids (one prompt)."""
    common = _common(body, "prompt")
    logprobs = _integer(body, "logprobs", 0, MAX_LOGPROBS)
    fields = {
        **common.pop("fields"),
        **_prompt(body.get("prompt")),
        "logprobs": None if logprobs is None else max(logprobs, 1),
    }
    return Generation(
        **common,
        fields=fields,
        logprobs=logprobs,
        default_max_tokens=COMPLETION_MAX_TOKENS,
        **_max_tokens(body),
    )


def _prompt(value: Any) -> dict[str, Any]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        return {"prompt": value}
    if isinstance(value, list) and value and all(is_token_id(t) for t in value):
        return {"tokens": value}
    if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        raise bad_field("prompt", "one prompt a request: a list of several is not supported")
    raise bad_field("prompt", "'prompt' must be a string or a non-empty list of token ids")
