"""How a step's message travels through the stage actors.

* ``direct`` (default): Ray places the actors and carries every control call, but activations
  travel over persistent, token-authenticated TCP links driver -> stage 0 -> ... -> driver
  (``links.py``): a hop is a socket write and read, and an idle stage blocks in ``recv``.
* ``chain``: ``s_n.step.remote(... s_1.step.remote(msg))``.  The driver submits the whole chain
  at once; each call starts as soon as its argument exists, with no Python round trip through the
  driver between stages -- but each hop is still a Ray task and its reply.  Works with any actor,
  fails call by call, and needs no port beyond Ray's own.
* ``compiled``: the same chain as a Ray Compiled Graph (shared-memory channels; the actors run a
  loop instead of receiving tasks).  Hops are fast, but each actor polls its channel, a core's
  worth of CPU even when idle; an actor is in one compiled graph at a time, executions in flight
  are capped, and when an actor dies the graph must be rebuilt.
* ``driver``: one ``ray.get`` per hop, the naive baseline the benchmark compares against.

All carry the same bytes and give the same answers; docs/cluster.md ("Choosing the channel") has
the measurements behind the default.
"""

from __future__ import annotations

from typing import Any

from ..errors import StageUnavailableError
from .cluster import call_all

CHANNELS = ("direct", "chain", "compiled", "driver")
#: Chosen by measurement (docs/cluster.md, "Choosing the channel").
DEFAULT_CHANNEL = "direct"


class Channel:
    kind = ""

    def __init__(self, actors: list) -> None:
        self.actors = list(actors)

    def submit(self, message: bytes) -> Any:
        raise NotImplementedError

    def get(self, handle: Any, timeout: float | None = None) -> bytes:
        import ray

        try:
            return ray.get(handle, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise StageUnavailableError(f"no reply from the pipeline within {timeout} s") from None
        except ray.exceptions.RayActorError as e:
            raise StageUnavailableError(f"a stage actor died: {e}") from None

    def close(self) -> None:
        pass


class ChainChannel(Channel):
    kind = "chain"

    def submit(self, message: bytes):
        ref = message
        for actor in self.actors:
            ref = actor.step.remote(ref)
        return ref


class DriverChannel(Channel):
    """A round trip through the driver for every hop: the baseline, not for production."""

    kind = "driver"

    def submit(self, message: bytes):
        return message  # the work happens in get(): nothing runs ahead

    def get(self, handle, timeout: float | None = None) -> bytes:
        data = handle
        for actor in self.actors:
            data = super().get(actor.step.remote(data), timeout)
        return data


class CompiledChannel(Channel):
    kind = "compiled"

    def __init__(self, actors: list, max_inflight: int = 16) -> None:
        super().__init__(actors)
        from ray.dag import InputNode

        with InputNode() as message:
            node = message
            for actor in self.actors:
                node = actor.step.bind(node)
        self._dag = node.experimental_compile(_max_inflight_executions=max_inflight)

    def submit(self, message: bytes):
        return self._dag.execute(message)

    def close(self) -> None:
        dag, self._dag = getattr(self, "_dag", None), None
        if dag is not None:
            dag.teardown()


class DirectChannel(Channel):
    kind = "direct"

    def __init__(self, actors: list, connect_timeout: float = 60.0) -> None:
        import secrets

        import ray

        from . import links

        super().__init__(actors)
        self._up = self._down = None
        token = secrets.token_bytes(links.TOKEN_BYTES)
        addresses = call_all(self.actors, "open_link", token, timeout=connect_timeout)
        acceptor = links.Acceptor(links.node_ip(), token, timeout=connect_timeout)
        try:
            downstream = [*addresses[1:], acceptor.address]  # each stage connects to the next; the last to us
            ray.get([a.link_to.remote(*addr) for a, addr in zip(self.actors, downstream)], timeout=connect_timeout)
            self._up = links.connect(*addresses[0], token)
            self._down = acceptor.wait(connect_timeout)
        except BaseException:
            acceptor.close()
            self.close()
            raise
        self._sent = self._received = 0
        self._ready: dict[int, bytes] = {}

    def submit(self, message: bytes) -> int:
        from . import links

        try:
            links.send_frame(self._up, message)
        except OSError as e:
            raise StageUnavailableError(f"the link to stage 0 is broken: {e}") from None
        self._sent += 1
        return self._sent

    def get(self, handle: int, timeout: float | None = None) -> bytes:
        import socket

        from . import links

        while handle not in self._ready:  # replies come back in submission order
            self._down.settimeout(timeout)
            try:
                frame = links.recv_frame(self._down)
            except socket.timeout:
                raise StageUnavailableError(f"no reply from the pipeline within {timeout} s") from None
            except (OSError, links.LinkClosed) as e:
                raise StageUnavailableError(f"the link from the last stage closed: {e}") from None
            self._received += 1
            self._ready[self._received] = frame
        frame = self._ready.pop(handle)
        error = links.frame_error(frame)
        if error is not None:
            raise error
        return frame

    def close(self) -> None:
        for sock in (self._up, self._down):
            if sock is not None:
                sock.close()
        self._up = self._down = None
        try:
            call_all(self.actors, "close_link", timeout=10)
        except Exception:  # noqa: BLE001 -- closing a pipeline whose actors died already
            pass


def make_channel(kind: str, actors: list, max_inflight: int = 16) -> Channel:
    """The channel, warmed: one empty frame has gone through every stage and back, so that what a
    first use sets up (a compiled graph's channels: seconds; the links' threads and buffers, the
    driver's decoding) is paid here, not in a session's time to first token."""
    if kind == "chain":
        channel = ChainChannel(actors)
    elif kind == "direct":
        channel = DirectChannel(actors)
    elif kind == "compiled":
        channel = CompiledChannel(actors, max_inflight)
    elif kind == "driver":
        channel = DriverChannel(actors)
    else:
        raise ValueError(f"channel must be one of {', '.join(CHANNELS)}, got {kind!r}")
    from ..transport import decode_message, encode_message

    for _ in range(2):
        decode_message(channel.get(channel.submit(encode_message({}, {"warmup": True})), timeout=120))
    return channel
