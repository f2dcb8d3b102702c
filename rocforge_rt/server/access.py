"""Who may use what: session tokens, CURVE keys, and the operator key.

A session belongs to whoever holds its token, never to a ZeroMQ routing id (a client
chooses its own, so it could take another's; and a client that reconnects gets a new
one). `open` and a one-shot `generate` reply with the token (128 random bits); every
later op on the session presents it. On a CURVE daemon the session is bound to the
client's authenticated public key as well. A missing or wrong token, or another key,
gets the answer of a session that does not exist (`unknown_session`), so tokens
cannot be probed; tokens are compared in constant time.

The operator ops (`stats` with `reset`, `trace`, `profile`) need the operator key
(`DaemonConfig.operator_key`) when the daemon binds beyond loopback.
"""

import hmac
import secrets
from dataclasses import dataclass

TOKEN_BYTES = 16  # 128 bits


def new_token() -> str:
    return secrets.token_hex(TOKEN_BYTES)


def same_secret(given: str | None, expected: str) -> bool:
    """Whether `given` is `expected`, compared in constant time (None never is)."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


@dataclass(frozen=True)
class Owner:
    """Who opened a session: its token, the routing id that opened it (its quota and its
    disconnection count there) and, on a CURVE daemon, the client's public key."""

    peer: bytes
    token: str
    user: str | None = None  # the CURVE public key (z85) that opened it; None without CURVE

    def admits(self, token: str | None, user: str | None) -> bool:
        """Whether a request with this token, from this CURVE key, may use the session."""
        return same_secret(token, self.token) and (self.user is None or self.user == user)


def operator_allowed(*, loopback: bool, configured: str | None, given: str | None) -> bool:
    """Whether an operator op may run: always on a loopback daemon, else only with the
    configured operator key (none configured: never)."""
    if loopback:
        return True
    return configured is not None and same_secret(given, configured)
