"""Which clients are still connected: the ROUTER socket's connections, through its monitor.

A ROUTER socket tells nobody when a peer goes. ZMQ_ROUTER_NOTIFY would (an empty
message with the peer's routing id), but it is a draft API, absent from the
released libzmq this runs on (setting it fails with EINVAL). Two stable features
do it instead:

- the socket monitor reports each connection's file descriptor when it is
  accepted (EVENT_ACCEPTED) and when it is disconnected (EVENT_DISCONNECTED:
  at once when the peer closes its socket or its process dies, or once the
  kernel gives up on a peer that stopped answering, below);
- each message carries the descriptor it came in on (ZMQ_SRCFD).

A peer that stops answering (its host died, its network went) closes nothing: TCP
keepalive probes an idle connection and the TCP user timeout bounds unacknowledged
replies (`watch_silent_peers`), so the kernel reports its connection broken after about
`SILENT_PEER_S` seconds and the monitor says DISCONNECTED. Not ZeroMQ's own heartbeats
(ZMQ_HEARTBEAT_IVL): with libzmq 4.3.5 a peer that fills its inbound queue and then
closes leaves a connection whose next heartbeat aborts the whole process (assertion
`!_io_error` in stream_engine_base.cpp).

So the peers seen on a descriptor are gone when the monitor says that descriptor
disconnected. libzmq emits a connection's ACCEPTED before any message of it can be
read, and its DISCONNECTED before its descriptor can be reused, and the monitor
delivers events in order; `PeerWatch.arrived` is called after `events` has read
every event pending, so a message is put on the connection that sent it even when
its descriptor was reused. A message read from a connection already reported
closed (it was queued before the peer left) means its peer is gone too.

Routing ids the ROUTER generates start with a zero byte (libzmq reserves those):
such a peer can never come back under its id, so its sessions can be closed. A
peer that set its own routing id may reconnect under it.
"""

import contextlib
import logging

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("rocforge.server")

EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
KEEPALIVE_IDLE_S = 2  # an idle connection is probed after this long
KEEPALIVE_INTERVAL_S = 2  # then every this long
KEEPALIVE_PROBES = 4  # unanswered probes before the connection is broken
SILENT_PEER_S = KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES


def watch_silent_peers(router: zmq.Socket) -> None:
    """Have the kernel break connections to peers that stop answering (set before bind):
    an idle one after SILENT_PEER_S of unanswered keepalive probes, one that leaves replies
    unacknowledged after SILENT_PEER_S too."""
    router.tcp_keepalive = 1
    router.tcp_keepalive_idle = KEEPALIVE_IDLE_S
    router.tcp_keepalive_intvl = KEEPALIVE_INTERVAL_S
    router.tcp_keepalive_cnt = KEEPALIVE_PROBES
    router.tcp_maxrt = SILENT_PEER_S * 1000  # TCP_USER_TIMEOUT on Linux


def generated_routing_id(peer: bytes) -> bool:
    """Whether the ROUTER made this routing id up (the peer did not name itself)."""
    return peer[:1] == b"\x00"


def source_fd(frame: zmq.Frame) -> int:
    """The descriptor of the connection a received frame came in on; -1 when unknown."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return -1


class PeerWatch:
    """The ROUTER's connections by descriptor and the routing ids seen on each."""

    def __init__(self, router: zmq.Socket) -> None:
        self._router = router
        self.socket = router.get_monitor_socket(EVENTS)
        self._peers: dict[int, set[bytes]] = {}  # open connection -> routing ids seen on it
        self._closed: set[int] = set()  # descriptors disconnected and not accepted since

    def events(self) -> list[bytes]:
        """Read the monitor's pending events; the routing ids whose connection closed (and
        that are seen on no other open connection)."""
        gone: list[bytes] = []
        while self.socket.poll(0):
            try:
                event = recv_monitor_message(self.socket, zmq.NOBLOCK)
            except zmq.Again:
                break
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._closed.discard(fd)
                self._peers[fd] = set()
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._closed.add(fd)
                gone.extend(self._peers.pop(fd, ()))
        return [p for p in gone if not any(p in seen for seen in self._peers.values())]

    def arrived(self, peer: bytes, fd: int) -> bool:
        """Note that a message of `peer` came in on descriptor `fd` (call `events` first);
        False when that connection has already closed: the peer is gone."""
        if fd in self._closed:
            return False
        if fd >= 0:
            self._peers.setdefault(fd, set()).add(peer)
        return True

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._router.disable_monitor()
        self.socket.close(linger=0)
