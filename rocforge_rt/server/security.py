"""CURVE keys for the daemon, and the rule that only loopback binds may go without them
(the HTTP front's: without an API key).

`rocforge keys DIR` writes, with pyzmq's zmq.auth:
  DIR/server.key, DIR/server.key_secret     the daemon's key pair (the secret stays there)
  DIR/client.key, DIR/client.key_secret     a client's key pair (give it to the client)
  DIR/authorized_clients/client.key         public keys of clients the daemon accepts
A daemon started with `--curve-keys DIR` encrypts every connection and accepts
only the clients in DIR/authorized_clients; a client needs its key pair and
server.key (its `curve_keys` folder holds client.key_secret and server.key).
"""

import ipaddress
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

from rocforge_rt.errors import RocforgeError, UsageError

AUTHORIZED_DIR = "authorized_clients"
LOCAL_TRANSPORTS = ("ipc", "inproc")
TRANSPORTS = ("tcp", *LOCAL_TRANSPORTS)
EPHEMERAL_PORTS = ("*", "0")  # bind only: the system picks a free port
API_KEY_ENV = "ROCFORGE_API_KEY"  # the HTTP front's API key, when no option gives it


class SecurityError(RocforgeError):
    """The daemon would be reachable by others without CURVE, or its keys are unusable."""


class AddressRefused(SecurityError, UsageError):
    """A listen or bind address malformed, or beyond loopback without a key."""


@dataclass(frozen=True)
class KeyPaths:
    server_public: Path
    server_secret: Path
    client_public: Path
    client_secret: Path
    authorized_dir: Path


def key_paths(keys_dir: Path) -> KeyPaths:
    return KeyPaths(
        server_public=keys_dir / "server.key",
        server_secret=keys_dir / "server.key_secret",
        client_public=keys_dir / "client.key",
        client_secret=keys_dir / "client.key_secret",
        authorized_dir=keys_dir / AUTHORIZED_DIR,
    )


def generate_keys(keys_dir: Path) -> KeyPaths:
    """Write a server and a client key pair and authorize the client (refuses to overwrite)."""
    paths = key_paths(keys_dir)
    existing = [p for p in (paths.server_secret, paths.client_secret) if p.exists()]
    if existing:
        raise SecurityError(f"{existing[0]} exists; remove it or choose another folder")
    import zmq.auth  # imports asyncio (~70 ms): where keys are made or read only

    keys_dir.mkdir(parents=True, exist_ok=True)
    paths.authorized_dir.mkdir(exist_ok=True)
    zmq.auth.create_certificates(keys_dir, "server")
    zmq.auth.create_certificates(keys_dir, "client")
    shutil.copy(paths.client_public, paths.authorized_dir / paths.client_public.name)
    for secret in (paths.server_secret, paths.client_secret):
        os.chmod(secret, 0o600)
    return paths


def endpoint_problem(endpoint: str, *, bind: bool) -> str | None:
    """Why a ZeroMQ endpoint cannot be bound (or connected to), or None if it can be tried.

    Accepted: tcp://HOST:PORT with PORT in 1-65535 (a bind may also take * or 0: a free
    port), ipc://PATH and inproc://NAME. ZeroMQ itself would take a port above 65535
    modulo 65536, and an address without a transport only with an obscure error.
    """
    examples = "addresses look like tcp://127.0.0.1:5555 or ipc:///tmp/rocforge.sock"
    transport, sep, rest = endpoint.partition("://")
    if not sep:
        return f"the scheme (transport) is missing: write tcp://{endpoint} ({examples})"
    if transport not in TRANSPORTS:
        known = ", ".join(f"{t}://" for t in TRANSPORTS)
        return f"unknown scheme {transport + '://'!r}: expected {known} ({examples})"
    if not rest:
        return f"no address after {transport}:// ({examples})"
    if transport != "tcp":
        return None
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        return f"a tcp address needs a host and a port: tcp://HOST:PORT ({examples})"
    if bind and port in EPHEMERAL_PORTS:
        return None
    if not re.fullmatch(r"[0-9]+", port) or not 1 <= int(port) <= 65535:
        free = " (or * for any free port)" if bind else ""
        return f"the port {port!r} is outside 1-65535{free}"
    return None


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for ipc/inproc and for tcp on a loopback address (127.0.0.0/8, ::1, localhost)."""
    transport, _, rest = endpoint.partition("://")
    if transport in LOCAL_TRANSPORTS:
        return True
    if transport != "tcp" or not rest:
        return False
    return is_loopback_host(rest.rsplit(":", 1)[0])


def is_loopback_host(host: str) -> bool:
    """True for a loopback address (127.0.0.0/8, ::1, [::1]) or localhost."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # '*', an interface name, or a host name
        return False


def parse_listen(listen: str) -> tuple[str, int]:
    """The host and port of an HTTP listen address, HOST:PORT or [IPv6]:PORT (port 0: any
    free one); SecurityError when malformed."""
    host, colon, port = listen.rpartition(":")
    host = host.strip("[]")
    if not colon or not host or not re.fullmatch(r"[0-9]+", port) or int(port) > 65535:
        raise AddressRefused(
            f"cannot listen on {listen!r}: expected HOST:PORT with PORT in 0-65535"
            " (examples: 127.0.0.1:8000, [::1]:8000, 0.0.0.0:8000)"
        )
    return host, int(port)


def check_http_listen(
    listen: str, api_key: str | None, key_option: str = "--api-key"
) -> tuple[str, int]:
    """Refuse a malformed HTTP listen address, and one beyond loopback without an API key
    (given by `key_option`); returns its host and port."""
    host, port = parse_listen(listen)
    if not api_key and not is_loopback_host(host):
        raise AddressRefused(
            f"refusing to listen on {listen} without an API key: only loopback addresses"
            " (127.0.0.1:PORT, [::1]:PORT, localhost:PORT) may serve HTTP without one; pass"
            f" {key_option} KEY (or set {API_KEY_ENV}): clients then send"
            " `Authorization: Bearer KEY`"
        )
    return host, port


def check_bind(endpoint: str, keys_dir: Path | None) -> None:
    """Refuse a malformed endpoint, and a non-loopback bind without CURVE keys."""
    problem = endpoint_problem(endpoint, bind=True)
    if problem is not None:
        raise AddressRefused(f"cannot bind {endpoint}: {problem}")
    if keys_dir is None and not is_loopback_endpoint(endpoint):
        raise AddressRefused(
            f"refusing to bind {endpoint} without encryption: only loopback addresses "
            "(tcp://127.0.0.1:PORT, ipc://...) may be bound without CURVE keys; make keys with "
            "`rocforge keys DIR` and pass --curve-keys DIR"
        )


def _load(path: Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise SecurityError(f"CURVE key file {path} is missing; make keys with `rocforge keys DIR`")
    import zmq.auth  # see generate_keys

    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise SecurityError(f"CURVE key file {path} is unreadable: {exc}") from None
    if secret and secret_key is None:
        raise SecurityError(f"CURVE key file {path} holds no secret key")
    return public, secret_key


def secure_server(
    context: zmq.Context, socket: zmq.Socket, keys_dir: Path
) -> "ThreadAuthenticator":
    """Make `socket` a CURVE server that accepts the authorized clients; returns the
    authenticator, which the caller stops when it closes the socket."""
    paths = key_paths(keys_dir)
    public, secret = _load(paths.server_secret, secret=True)
    if not paths.authorized_dir.is_dir():
        raise SecurityError(f"{paths.authorized_dir} is missing: no client could connect")
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve(domain="*", location=str(paths.authorized_dir))
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_server = True
    return auth


def client_keys(keys_dir: Path) -> tuple[bytes, bytes, bytes]:
    """A CURVE client's public and secret keys and the server's public key, from `keys_dir`;
    SecurityError naming a file missing or unreadable."""
    paths = key_paths(keys_dir)
    public, secret = _load(paths.client_secret, secret=True)
    server_public, _ = _load(paths.server_public, secret=False)
    return public, secret, server_public


def secure_client(socket: zmq.Socket, keys_dir: Path) -> None:
    """Make `socket` a CURVE client with the key pair and server key found in `keys_dir`."""
    public, secret, server_public = client_keys(keys_dir)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_serverkey = server_public
