"""A connection to one daemon: its DEALER socket (CURVE where keys are given) and the
transport every call goes through: `send` a request, `receive` its reply, `call` both."""

import itertools
import time
from pathlib import Path
from typing import Any, Self

import msgpack
import zmq

from rocforge_client.errors import BadAddress, Timeout, raise_for_error
from rocforge_rt.server.security import endpoint_problem, secure_client

MAX_REPLY_BYTES = 64 << 20


class Connection:
    """A DEALER socket connected to one daemon; calls are sequential (one thread)."""

    def __init__(
        self,
        addr: str,
        *,
        curve_keys: str | Path | None = None,
        timeout: float = 30.0,
        context: zmq.Context | None = None,
    ) -> None:
        problem = endpoint_problem(addr, bind=False)
        if problem is not None:
            raise BadAddress(f"cannot connect to {addr}: {problem}")
        self.addr = addr
        self.timeout = timeout
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.linger = 0
        self._socket.maxmsgsize = MAX_REPLY_BYTES
        # a send waits for a connection no longer than a reply would (a handshake refused,
        # say: ZeroMQ drops the pipe it would queue on, and a send then blocks)
        self._socket.sndtimeo = max(1, int(timeout * 1000))
        try:
            if curve_keys is not None:
                secure_client(self._socket, Path(curve_keys))
            self._socket.connect(addr)
        except zmq.ZMQError as exc:  # a host name that does not resolve, say
            self._socket.close(linger=0)
            raise BadAddress(f"cannot connect to {addr}: {exc}") from None
        except BaseException:
            self._socket.close(linger=0)
            raise
        self._ids = itertools.count(1)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.disconnect()

    @property
    def socket(self) -> zmq.Socket:
        """The DEALER socket, to poll several clients from one thread: a client whose socket
        is readable has a reply for `receive`."""
        return self._socket

    def disconnect(self) -> None:
        """Close the socket (sessions stay open on the daemon until closed or idle)."""
        self._socket.close(linger=0)

    def send(self, op: str, **fields: Any) -> int:
        """Send a request (fields that are None are left out); returns its id."""
        rid = next(self._ids)
        request = {"op": op, "id": rid, **{k: v for k, v in fields.items() if v is not None}}
        try:
            self._socket.send(msgpack.packb(request, use_bin_type=True))
        except zmq.Again:
            raise Timeout(f"could not send to {self.addr} in time (not connected)") from None
        return rid

    def receive(self, rid: int, timeout: float | None = None) -> dict[str, Any]:
        """The next reply to request `rid` (replies to other ids are dropped)."""
        limit = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            left = limit - time.monotonic()
            if left <= 0 or not self._socket.poll(max(1, int(left * 1000))):
                raise Timeout(f"no reply from {self.addr} to request {rid} in time")
            reply = msgpack.unpackb(self._socket.recv_multipart()[-1], raw=False)
            if not isinstance(reply, dict):
                continue
            if reply.get("id") == rid:
                return reply
            if reply.get("id") is None and not reply.get("ok"):  # the daemon could not read an id
                raise_for_error(reply)

    def call(self, op: str, *, timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        """One request, one reply; raises the reply's error."""
        reply = self.receive(self.send(op, **fields), timeout)
        raise_for_error(reply)
        return reply
