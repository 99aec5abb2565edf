"""Both ends of a link probe over plain TCP, as processes run inside lab namespaces.

``python -m tests.lab.link_peer answer PORT`` listens on ``0.0.0.0:PORT``, prints
``listening`` once it does, and answers the probes of one connection through
:class:`~meshnode.node.links.LinkBook` until it closes. ``python -m tests.lab.link_peer
measure HOST PORT`` connects, measures the link with ``LinkBook.measure`` (an empty probe,
then one of ``PROBE_BYTES``) and prints the rate in bytes a second (``none`` when not
answered). The codec, the framing and the timing are meshnode's own; only the TLS of a
real session is left out (the daemon's wiring is tested on loopback in
``tests/node/test_links.py``).
"""

from __future__ import annotations

import sys

import trio
from meshnode_protocol import (
    LINK_PROBE_FEATURE,
    Connection,
    Hello,
    LinkProbe,
    LinkProbeReply,
    Role,
)

from meshnode.net.stream import PeerStream
from meshnode.node.links import LinkBook


def _hello(name: str) -> Hello:
    return Hello(
        features=(LINK_PROBE_FEATURE,),
        node_id=name,
        mesh_id_hash="lab",
        listen_address="0.0.0.0:1",
        device_kind="cpu",
        usable_memory=0,
    )


async def answer(port: int) -> None:
    book = LinkBook("answerer")
    done = trio.Event()

    async def serve(tcp: trio.SocketStream) -> None:
        peer = PeerStream(tcp, Connection(Role.LISTENER))
        await peer.receive()  # its Hello
        await peer.send(_hello("answerer"))
        while (message := await peer.receive()) is not None:
            if isinstance(message, LinkProbe):
                reply = book.answer("measurer", message, trio.current_time())
                if reply is not None:
                    await peer.send(reply)
        done.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_tcp, serve, port)
        print("listening", flush=True)
        await done.wait()
        nursery.cancel_scope.cancel()


async def measure(host: str, port: int) -> None:
    book = LinkBook("measurer")
    tcp = await trio.open_tcp_stream(host, port)
    peer = PeerStream(tcp, Connection(Role.DIALER))
    await peer.send(_hello("measurer"))
    await peer.receive()  # its Hello
    async with trio.open_nursery() as nursery:

        async def replies() -> None:
            while (message := await peer.receive()) is not None:
                if isinstance(message, LinkProbeReply):
                    book.answered("answerer", message)

        nursery.start_soon(replies)
        rate = await book.measure("answerer", peer.send)
        print("none" if rate is None else f"{rate:.0f}", flush=True)
        nursery.cancel_scope.cancel()
    await tcp.aclose()


def main(argv: list[str]) -> None:
    if argv[0] == "answer":
        trio.run(answer, int(argv[1]))
    else:
        trio.run(measure, argv[1], int(argv[2]))


if __name__ == "__main__":
    main(sys.argv[1:])
