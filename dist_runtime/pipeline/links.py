"""Direct TCP links between stages: the ``direct`` channel's data plane.

Ray stays the control plane (placing actors, loading weights, reset, reports, telemetry); the
activations travel over one persistent TCP connection per hop -- driver -> stage 0 -> ... -> stage
n-1 -> driver -- as length-prefixed frames, each frame one ``transport`` message.  A hop then costs
a socket write and read instead of a Ray task submission and reply (measured in docs/cluster.md).

* **Authentication**: the driver makes a random 32-byte token per pipeline and gives it to the
  stages through Ray (whose own control plane is token-authenticated); a connection is accepted
  only after its first bytes are ``MAGIC + token``, compared in constant time.
* **Encryption**: when Ray itself runs with TLS (``RAY_USE_TLS=1`` and ``RAY_TLS_SERVER_CERT``,
  ``RAY_TLS_SERVER_KEY``, ``RAY_TLS_CA_CERT`` on every node), the links use the same certificates
  for mutual TLS; otherwise frames travel in the clear, like Ray's own traffic without TLS.
* **Hostile input**: a frame longer than the transport's message limit closes that connection
  before anything is read into memory; anything else wrong with a frame is the stage's own
  ``TransportError`` for that step, carried downstream as an error frame.
* **Order**: each stage answers every frame with exactly one frame (its reply, or an error frame
  that later stages pass on untouched), so the driver matches replies to steps by order.
"""

from __future__ import annotations

import hmac
import os
import socket
import ssl
import struct
import threading
from typing import Callable

from ..errors import DistRuntimeError, StageUnavailableError, TransportError
from ..transport import MAX_MESSAGE_BYTES, decode_message, encode_message

MAGIC = b"DRLINK1\n"
TOKEN_BYTES = 32
_LEN = struct.Struct("<Q")
#: A frame may carry a whole message plus nothing else.
MAX_FRAME = MAX_MESSAGE_BYTES


class LinkClosed(DistRuntimeError):
    """The other end closed the connection (or it broke)."""


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise LinkClosed("connection closed")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket) -> bytes:
    (size,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if size > MAX_FRAME:
        raise TransportError(f"a frame of {size:,} bytes exceeds the limit of {MAX_FRAME:,}")
    return recv_exact(sock, size)


def send_frame(sock: socket.socket, data: bytes) -> None:
    if len(data) < 65536:
        sock.sendall(_LEN.pack(len(data)) + data)  # one write: small frames are the common case
    else:
        sock.sendall(_LEN.pack(len(data)))
        sock.sendall(data)  # no copy into a joined buffer


def node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 -- outside Ray (tests): loopback
        return "127.0.0.1"


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames must not wait


def tls_context(server_side: bool) -> ssl.SSLContext | None:
    """Mutual TLS with Ray's own certificates when Ray runs with TLS, else None."""
    if os.environ.get("RAY_USE_TLS", "0").strip().lower() not in ("1", "true"):
        return None
    files = [os.environ.get(v) for v in ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")]
    if not all(files):
        raise DistRuntimeError("RAY_USE_TLS is set, but not all of RAY_TLS_SERVER_CERT, RAY_TLS_SERVER_KEY "
                               "and RAY_TLS_CA_CERT")
    cert, key, ca = files
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    ctx.verify_mode = ssl.CERT_REQUIRED  # both ends prove they hold a certificate of the cluster's CA
    if not server_side:
        ctx.check_hostname = False  # node certificates rarely name every address a node has
    return ctx


def listen(host: str) -> socket.socket:
    server = socket.create_server((host, 0), backlog=4)
    return server


def accept_authenticated(server: socket.socket, token: bytes, timeout: float | None = None) -> socket.socket:
    """The first connection that presents ``token``; others are closed unread beyond the hello."""
    server.settimeout(timeout)
    while True:
        try:
            conn, _ = server.accept()
        except socket.timeout:
            raise StageUnavailableError(f"no authenticated connection within {timeout} s") from None
        conn.settimeout(10.0)
        try:
            tls = tls_context(server_side=True)
            if tls is not None:
                conn = tls.wrap_socket(conn, server_side=True)
            hello = recv_exact(conn, len(MAGIC) + TOKEN_BYTES)
        except (OSError, LinkClosed):
            conn.close()
            continue
        if hmac.compare_digest(hello, MAGIC + token):
            conn.settimeout(None)
            _tune(conn)
            return conn
        conn.close()


def connect(host: str, port: int, token: bytes, timeout: float = 30.0) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout)
    _tune(sock)
    tls = tls_context(server_side=False)
    if tls is not None:
        sock = tls.wrap_socket(sock)
    sock.sendall(MAGIC + token)
    sock.settimeout(None)
    return sock


def error_frame(error: BaseException, stage: int) -> bytes:
    return encode_message({}, {"error": {"type": type(error).__name__, "message": str(error), "stage": stage}})


#: Error frames are small; bigger frames are never decoded just to look for one.
_ERROR_FRAME_MAX = 4096


def frame_error(frame: bytes) -> DistRuntimeError | None:
    """The error an error frame carries (a ``TransportError`` stays one), or None."""
    if len(frame) > _ERROR_FRAME_MAX:
        return None
    try:
        tensors, meta = decode_message(frame)
    except TransportError:
        return None  # not an error frame: the receiving stage's own decode will judge it
    err = meta.get("error")
    if tensors or not isinstance(err, dict):
        return None
    kind = TransportError if err.get("type") == "TransportError" else DistRuntimeError
    return kind(f"stage {err.get('stage')}: {err.get('type')}: {err.get('message')}")


class Acceptor:
    """Accept one authenticated connection in a background thread.

    The accepting side must be running before its peer connects: with TLS, the peer's connect
    waits for the handshake, and the peers of a pipeline connect while their neighbours are still
    being set up.
    """

    def __init__(self, host: str, token: bytes, timeout: float | None = None) -> None:
        self._server = listen(host)
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self.conn: socket.socket | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(token, timeout), daemon=True,
                                        name="link-accept")
        self._thread.start()

    def _run(self, token: bytes, timeout: float | None) -> None:
        try:
            self.conn = accept_authenticated(self._server, token, timeout)
        except BaseException as e:  # noqa: BLE001 -- handed to whoever waits for the connection
            self.error = e
        finally:
            self._server.close()  # one peer per link: nobody else may connect

    def wait(self, timeout: float | None = None) -> socket.socket:
        self._thread.join(timeout)
        if self.conn is None:
            raise self.error or StageUnavailableError(f"no connection within {timeout} s")
        return self.conn

    def close(self) -> None:
        self._server.close()
        if self.conn is not None:
            self.conn.close()


class StageLink:
    """The stage side: accept the upstream connection, run ``step`` on each frame, send the reply
    (or an error frame) downstream.  Runs in a daemon thread of the stage actor."""

    def __init__(self, stage: int, step: Callable[[bytes], bytes], token: bytes) -> None:
        self.stage, self._step, self._token = stage, step, token
        self._upstream = Acceptor(node_ip(), token)
        self._down: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.closed = False
        self.frames = 0

    @property
    def address(self) -> tuple[str, int]:
        return self._upstream.address

    def connect_downstream(self, host: str, port: int) -> None:
        self._down = connect(host, port, self._token)
        self._thread = threading.Thread(target=self._serve, name=f"stage{self.stage}-link", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            up = self._upstream.wait()
            while not self.closed:
                frame = recv_frame(up)
                self.frames += 1
                if frame_error(frame) is not None:
                    reply = frame  # an earlier stage failed this step: pass its error on
                else:
                    try:
                        reply = self._step(frame)
                    except Exception as e:  # noqa: BLE001 -- one bad step must not end the link
                        reply = error_frame(e, self.stage)
                send_frame(self._down, reply)
        except (OSError, LinkClosed, TransportError, StageUnavailableError):
            pass  # the pipeline is closing, or a peer died: the driver sees its link close
        finally:
            self.close()

    def close(self) -> None:
        self.closed = True
        self._upstream.close()
        if self._down is not None:
            try:
                self._down.close()
            except OSError:
                pass
