"""From a validated request to the engine's arguments, and from engine errors to reply codes.

protocol.py checks what a request may hold whatever the daemon; this module
checks what depends on the daemon and its model (the limits, the context
window, the vocabulary) and builds the engine's arguments. Every refusal is a
ProtocolError with the code of its reply; an engine refusal carries an
`EngineErrorCode`, and `ENGINE_ERROR_CODES` is the one table of their reply codes.
"""

from typing import Any

from rocforge_rt.engine.session import Session
from rocforge_rt.errors import EngineErrorCode
from rocforge_rt.model.tokenizer import Tokenizer
from rocforge_rt.server.jobs import Limits
from rocforge_rt.server.protocol import ErrorCode, Prompt, ProtocolError, Turn

ENGINE_ERROR_CODES: dict[EngineErrorCode, ErrorCode] = {
    EngineErrorCode.BUSY: ErrorCode.BUSY,
    EngineErrorCode.CONTEXT_FULL: ErrorCode.CONTEXT_FULL,
    EngineErrorCode.INVALID_ARGUMENT: ErrorCode.BAD_REQUEST,
    EngineErrorCode.TURN_RUNNING: ErrorCode.SESSION_BUSY,
    # the daemon decodes only sessions it prefilled, and starts the engine before serving:
    # either one reaching a request is a bug
    EngineErrorCode.NOT_DECODABLE: ErrorCode.INTERNAL,
    EngineErrorCode.BAD_CONFIG: ErrorCode.INTERNAL,
}


def max_token_bytes(tokenizer: Tokenizer | None) -> int | None:
    """The most bytes any one token of the vocabulary stands for (None: no vocabulary)."""
    if tokenizer is None:
        return None
    return max(1, max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.n_vocab)))


def check_prompt_bytes(limits: Limits, token_bytes: int | None, prompt: Prompt) -> None:
    """Refuse, before tokenizing it, a text prompt certain to be over --max-prompt-tokens:
    more bytes than that many tokens of the vocabulary's longest can hold (chat messages:
    their contents alone). Cheap: the I/O thread checks it before the engine thread spends
    time on a huge prompt."""
    if token_bytes is None or prompt.tokens is not None:
        return
    texts = [prompt.text] if prompt.text is not None else [c for _, c in prompt.messages or ()]
    size = sum(len(text.encode("utf-8")) for text in texts)
    most = limits.max_prompt_tokens * token_bytes
    if size > most:
        raise ProtocolError(
            ErrorCode.LIMIT_EXCEEDED,
            f"prompt of {size} bytes is over {limits.max_prompt_tokens} tokens"
            f" (--max-prompt-tokens) of at most {token_bytes} bytes each ({most} bytes)",
        )


def prompt_ids(tokenizer: Tokenizer | None, prompt: Prompt, *, first_turn: bool) -> list[int]:
    """The token ids of a turn's prompt (text is tokenized, chat messages rendered first)."""
    if prompt.tokens is not None:
        return list(prompt.tokens)
    if tokenizer is None:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, "this model has no vocabulary: send 'tokens', not text"
        )
    if prompt.messages is not None:
        messages = [{"role": r, "content": c} for r, c in prompt.messages]
        try:
            return tokenizer.encode_chat(messages)
        except ValueError as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc)) from None
    return tokenizer.encode(prompt.text, add_bos=None if first_turn else False)


def turn_args(limits: Limits, n_vocab: int, turn: Turn, ids: list[int]) -> dict[str, Any]:
    """The keyword arguments of `Engine.open_session`/`append` for a turn, within the limits
    and the model's vocabulary (the turn's sampling was checked as it was parsed)."""
    if not ids:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "the prompt has no tokens")
    if len(ids) >= limits.n_ctx:
        raise ProtocolError(
            ErrorCode.CONTEXT_FULL,
            f"a turn of {len(ids)} tokens cannot fit in ctx size {limits.n_ctx}",
        )
    if len(ids) > limits.max_prompt_tokens:
        raise ProtocolError(
            ErrorCode.LIMIT_EXCEEDED,
            f"prompt of {len(ids)} tokens exceeds the limit of {limits.max_prompt_tokens}"
            " (--max-prompt-tokens)",
        )
    max_tokens = turn.max_tokens or limits.max_new_tokens
    if max_tokens > limits.max_new_tokens:
        raise ProtocolError(
            ErrorCode.LIMIT_EXCEEDED,
            f"max_tokens {max_tokens} exceeds the limit of {limits.max_new_tokens}"
            " (--max-new-tokens)",
        )
    top_k = turn.sampling.top_k
    if top_k > n_vocab:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"field 'top_k': expected at most the vocabulary's {n_vocab} tokens, found {top_k}",
        )
    return {"sampling": turn.sampling, "stop": turn.stop, "max_tokens": max_tokens}


def check_room(limits: Limits, n_vocab: int, session: Session, ids: list[int]) -> None:
    """A further turn must fit in the session's context and use only the model's vocabulary."""
    if session.n_context + len(ids) >= limits.n_ctx:
        raise ProtocolError(
            ErrorCode.CONTEXT_FULL,
            f"{session.n_context} tokens in context + {len(ids)} new leave no room"
            f" in ctx size {limits.n_ctx}",
        )
    bad = [t for t in ids if t >= n_vocab]
    if bad:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"token id {bad[0]} is outside the vocabulary")
