"""The daemon's token replies as OpenAI objects: whole completions and streamed chunks.

A `Shaper` takes one generation's replies in order. Without streaming, `add` each and
`whole` makes the `chat.completion` / `text_completion` object; streaming, `chunks(reply)`
makes that reply's `chat.completion.chunk` / `text_completion` chunks (the first chat
chunk carries the assistant role, the last one the finish reason, and with
`stream_options.include_usage` one more follows with `usage` and no choices). Each daemon
reply holds whole characters (the daemon holds a character split across tokens back to the
token that completes it), so every chunk is valid UTF-8 on its own.

Finish reasons: the daemon's `stop_token` and `stop_string` are `stop`, `length` (its
max_tokens, or the end of the context window) is `length`, and `abort` stays `abort` (the
daemon cut the generation short, shutting down: a string the OpenAI SDK passes through,
where `null` would read as a stream that has not ended).
"""

import time
import uuid
from typing import Any

from rocforge_rt.server.http.openai_requests import Generation

FINISH_REASONS = {"stop_token": "stop", "stop_string": "stop", "length": "length", "abort": "abort"}


def finish_reason(daemon_reason: str | None) -> str | None:
    return None if daemon_reason is None else FINISH_REASONS.get(daemon_reason, daemon_reason)


def usage(daemon_usage: dict[str, Any]) -> dict[str, int]:
    prompt, completion = (
        daemon_usage.get("prompt_tokens", 0),
        daemon_usage.get("completion_tokens", 0),
    )
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _token_string(raw: bytes | None, token_id: int) -> str:
    """A token as text: its bytes decoded (a piece of a character shows as U+FFFD), or its id
    where the daemon sent no bytes (a model without a vocabulary)."""
    return f"token_id:{token_id}" if raw is None else raw.decode("utf-8", errors="replace")


def _alternatives(token: dict[str, Any], count: int) -> list[tuple[str, float, bytes | None]]:
    """A token's best `count` alternatives: (text, logprob, bytes)."""
    pairs = token.get("top_logprobs", [])[:count]
    raws = token.get("top_bytes") or [None] * len(pairs)
    return [(_token_string(raw, t), lp, raw) for (t, lp), raw in zip(pairs, raws, strict=False)]


class Shaper:
    """One generation's replies as OpenAI objects (see the module docstring)."""

    object_whole = ""
    object_chunk = ""
    id_prefix = ""

    def __init__(self, generation: Generation, model: str) -> None:
        self.generation = generation
        self.model = model
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, int] | None = None

    # --- shared -------------------------------------------------------------------------------
    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def _end(self, reply: dict[str, Any]) -> bool:
        """Note a reply's finish reason and usage; whether it is the last."""
        last = reply.get("done", True)
        if last:
            self.finish_reason = finish_reason(reply.get("finish_reason"))
            self.usage = usage(reply.get("usage", {}))
        return last

    def add(self, reply: dict[str, Any]) -> None:
        """A reply of a generation that is not streamed."""
        self.text.append(reply["text"])
        self._add_logprobs(reply["tokens"])
        self._end(reply)

    def whole(self) -> dict[str, Any]:
        return {
            **self._head(self.object_whole),
            "choices": [self._whole_choice("".join(self.text))],
            "usage": self.usage,
        }

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def chunks(self, reply: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks of one reply of a streamed generation."""
        last = self._end(reply)
        logprobs = self._chunk_logprobs(reply["tokens"])
        out = []
        if reply["text"] or logprobs is not None or last:
            choice = self._chunk_choice(
                reply["text"], logprobs, self.finish_reason if last else None
            )
            out.append(self._chunk([choice]))
        if last and self.generation.include_usage:
            out.append({**self._head(self.object_chunk), "choices": [], "usage": self.usage})
        return out

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {**self._head(self.object_chunk), "choices": choices}
        if self.generation.include_usage:
            chunk["usage"] = None
        return chunk

    # --- per kind -----------------------------------------------------------------------------
    def _add_logprobs(self, tokens: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def _chunk_logprobs(self, tokens: list[dict[str, Any]]) -> dict[str, Any] | None:
        raise NotImplementedError

    def _whole_choice(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def _chunk_choice(
        self, text: str, logprobs: dict[str, Any] | None, reason: str | None
    ) -> dict[str, Any]:
        raise NotImplementedError


class ChatShaper(Shaper):
    """`chat.completion` and `chat.completion.chunk`; logprobs as `{"content": [...]}`."""

    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, generation: Generation, model: str) -> None:
        super().__init__(generation, model)
        self.logprobs: list[dict[str, Any]] = []

    def _entry(self, token: dict[str, Any]) -> dict[str, Any]:
        raw = token.get("bytes")
        return {
            "token": _token_string(raw, token["token"]),
            "logprob": token["logprob"],
            "bytes": None if raw is None else list(raw),
            "top_logprobs": [
                {"token": text, "logprob": lp, "bytes": None if b is None else list(b)}
                for text, lp, b in _alternatives(token, self.generation.logprobs or 0)
            ],
        }

    def _add_logprobs(self, tokens: list[dict[str, Any]]) -> None:
        if self.generation.logprobs is not None:
            self.logprobs.extend(self._entry(t) for t in tokens)

    def _chunk_logprobs(self, tokens: list[dict[str, Any]]) -> dict[str, Any] | None:
        if self.generation.logprobs is None or not tokens:
            return None
        return {"content": [self._entry(t) for t in tokens], "refusal": None}

    def _whole_choice(self, text: str) -> dict[str, Any]:
        logprobs = None
        if self.generation.logprobs is not None:
            logprobs = {"content": self.logprobs, "refusal": None}
        return {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": logprobs,
            "finish_reason": self.finish_reason,
        }

    def opening_chunks(self) -> list[dict[str, Any]]:
        """The first chunk names the role, as OpenAI's do."""
        delta = {"role": "assistant", "content": ""}
        return [
            self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])
        ]

    def _chunk_choice(
        self, text: str, logprobs: dict[str, Any] | None, reason: str | None
    ) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}


class CompletionShaper(Shaper):
    """`text_completion` (whole and chunks); logprobs in the legacy columns: tokens,
    token_logprobs, top_logprobs (a map a token), text_offset (in the completion's text)."""

    object_whole = "text_completion"
    object_chunk = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, generation: Generation, model: str) -> None:
        super().__init__(generation, model)
        self.offset = 0  # characters of token text so far
        self.columns = self._columns([])

    def _columns(self, tokens: list[dict[str, Any]]) -> dict[str, list[Any]]:
        columns: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for token in tokens:
            text = _token_string(token.get("bytes"), token["token"])
            columns["tokens"].append(text)
            columns["token_logprobs"].append(token["logprob"])
            alternatives = _alternatives(token, self.generation.logprobs or 0)
            columns["top_logprobs"].append({t: lp for t, lp, _ in alternatives})
            columns["text_offset"].append(self.offset)
            self.offset += len(text)
        return columns

    def _add_logprobs(self, tokens: list[dict[str, Any]]) -> None:
        if self.generation.logprobs is not None:
            for name, values in self._columns(tokens).items():
                self.columns[name].extend(values)

    def _chunk_logprobs(self, tokens: list[dict[str, Any]]) -> dict[str, Any] | None:
        if self.generation.logprobs is None or not tokens:
            return None
        return self._columns(tokens)

    def _whole_choice(self, text: str) -> dict[str, Any]:
        logprobs = self.columns if self.generation.logprobs is not None else None
        return {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": self.finish_reason}

    def _chunk_choice(
        self, text: str, logprobs: dict[str, Any] | None, reason: str | None
    ) -> dict[str, Any]:
        return {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": reason}
