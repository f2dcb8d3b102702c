"""Generation: sessions (open, append, step, close), streamed `generate`, `abort`, the
session tokens a client holds, and the replies they bring (`TokenReply`)."""

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rocforge_client.connection import Connection
from rocforge_client.errors import raise_for_error


@dataclass(frozen=True)
class Token:
    token: int
    text: str
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenReply:
    """Tokens from open, append, step, or one message of a generate stream."""

    session: int
    tokens: tuple[Token, ...]
    text: str  # the text this reply releases (UTF-8-safe, stop strings cut)
    finish_reason: str | None  # stop_token, stop_string, length, abort, error; None: going on
    done: bool  # the request has ended (always True except mid-stream)
    usage: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    abort_reason: str | None = None
    token: str | None = None  # the session's token: in the first reply of the op that opened it

    @classmethod
    def from_reply(cls, reply: Mapping[str, Any]) -> "TokenReply":
        tokens = tuple(
            Token(t["token"], t["text"], t["logprob"], tuple(map(tuple, t.get("top_logprobs", ()))))
            for t in reply["tokens"]
        )
        return cls(
            session=reply["session"],
            tokens=tokens,
            text=reply["text"],
            finish_reason=reply["finish_reason"],
            done=reply.get("done", True),
            usage=reply.get("usage", {}),
            timings=reply.get("timings", {}),
            abort_reason=reply.get("abort_reason"),
            token=reply.get("token"),
        )


class Sessions(Connection):
    """A connection's generation calls and the token it holds for each session (from
    open/generate, or adopt), sent with every later op on that session."""

    @functools.cached_property
    def _tokens(self) -> dict[int, str]:
        """Session -> its token (from open/generate, or adopt)."""
        return {}

    def adopt(self, session: int, token: str) -> None:
        """Use `token` for `session` from now on (a session opened by another connection)."""
        self._tokens[session] = token

    def token(self, session: int) -> str | None:
        """The token this client holds for `session` (None: none)."""
        return self._tokens.get(session)

    def _remember(self, reply: "TokenReply") -> "TokenReply":
        if reply.token is not None:
            self._tokens[reply.session] = reply.token
        return reply

    def _token_for(self, session: int, token: str | None) -> str | None:
        if token is not None:
            self._tokens[session] = token
        return self._tokens.get(session)

    def open(
        self,
        prompt: str | None = None,
        *,
        tokens: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        deadline: float | None = None,
        timeout: float | None = None,
        **turn: Any,
    ) -> TokenReply:
        """Open a session with a prompt; the reply holds its id and first token.

        `turn` takes max_tokens, temperature, top_k, top_p, min_p, repetition_penalty,
        frequency_penalty, presence_penalty, seed, logprobs and stop (the protocol's turn
        fields; README.md, "Protocol"; the sampling rules: rocforge_rt/step/sampling.py).
        """
        fields = _turn_fields(prompt, tokens, messages, deadline, turn)
        return self._remember(TokenReply.from_reply(self.call("open", timeout=timeout, **fields)))

    def append(
        self,
        session: int,
        prompt: str | None = None,
        *,
        tokens: Sequence[int] | None = None,
        deadline: float | None = None,
        timeout: float | None = None,
        token: str | None = None,
        **turn: Any,
    ) -> TokenReply:
        """Another turn (text or ids) into a session; the reply holds its first token.
        `turn` takes what `open`'s does."""
        fields = _turn_fields(prompt, tokens, None, deadline, turn)
        token = self._token_for(session, token)
        return TokenReply.from_reply(
            self.call("append", timeout=timeout, session=session, token=token, **fields)
        )

    def step(
        self,
        session: int,
        n: int = 1,
        *,
        deadline: float | None = None,
        timeout: float | None = None,
        token: str | None = None,
    ) -> TokenReply:
        """The next n tokens of a session's turn (fewer if the turn ends)."""
        token = self._token_for(session, token)
        reply = self.call(
            "step", timeout=timeout, session=session, n=n, deadline_ms=_ms(deadline), token=token
        )
        return TokenReply.from_reply(reply)

    def generate(
        self,
        prompt: str | None = None,
        *,
        session: int | None = None,
        tokens: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        deadline: float | None = None,
        timeout: float | None = None,
        token: str | None = None,
        **turn: Any,
    ) -> Iterator[TokenReply]:
        """Stream a generation: of a new prompt (in a session of its own, closed at the end),
        or the rest of an open session's turn. The last reply has `done` True. Leaving the
        loop early aborts the request. A new prompt's `turn` takes what `open`'s does."""
        if session is not None:
            token = self._token_for(session, token)
            fields: dict[str, Any] = {"session": session, "deadline_ms": _ms(deadline)}
            fields["token"] = token
        else:
            fields = _turn_fields(prompt, tokens, messages, deadline, turn)
        rid = self.send("generate", **fields)
        done = False
        try:
            while not done:
                reply = self.receive(rid, timeout)
                raise_for_error(reply)
                result = self._remember(TokenReply.from_reply(reply))
                done = result.done
                if done and session is None:  # its own session closed with it
                    self._tokens.pop(result.session, None)
                yield result
        finally:
            if not done:
                self.send("abort", request=rid)

    def abort(
        self,
        *,
        session: int | None = None,
        request: int | None = None,
        timeout: float | None = None,
        token: str | None = None,
    ) -> bool:
        """Stop the request running on a session (or with that id); False if none was."""
        if session is not None:
            token = self._token_for(session, token)
        fields = {"session": session, "request": request, "token": token}
        return self.call("abort", timeout=timeout, **fields)["aborted"]

    def close(
        self, session: int, *, timeout: float | None = None, token: str | None = None
    ) -> dict[str, Any]:
        """Close a session (aborting its running request) and free its slot."""
        reply = self.call(
            "close", timeout=timeout, session=session, token=self._token_for(session, token)
        )
        self._tokens.pop(session, None)
        return reply


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _turn_fields(
    prompt: str | None,
    tokens: Sequence[int] | None,
    messages: Sequence[Mapping[str, str]] | None,
    deadline: float | None,
    turn: Mapping[str, Any],
) -> dict[str, Any]:
    stop = turn.get("stop")
    return {
        **turn,
        "prompt": prompt,
        "tokens": None if tokens is None else list(tokens),
        "messages": None if messages is None else [dict(m) for m in messages],
        "stop": [stop] if isinstance(stop, str) else (list(stop) if stop else None),
        "deadline_ms": _ms(deadline),
    }
