"""Per-frame cost of the hot path: encode + decode of one decode-step ActivationFrame.

    .venv/bin/python protocol/bench_codec.py [--frames N] [--hidden H]

Prints microseconds per frame for send_into (reused buffer), next_message, and both.
"""

from __future__ import annotations

import argparse
import time

from meshnode_protocol import ActivationFrame, Connection, Hello, Role, Tensor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--frames", type=int, default=20000)
    parser.add_argument("--hidden", type=int, default=576)  # SmolLM2-135M's hidden size
    args = parser.parse_args()
    hello = Hello(
        node_id="n", mesh_id_hash="m", listen_address="a", device_kind="cpu", usable_memory=0
    )
    sender, receiver = Connection(Role.DIALER), Connection(Role.LISTENER)
    receiver.receive_data(sender.send(hello))
    receiver.next_message()
    frame = ActivationFrame(
        request_id="req-0123456789", run_id="run-7f3a", term=3, kind="decode", start_pos=1234,
        tokens=(4242,), payload=Tensor("f16", (1, args.hidden), bytes(2 * args.hidden)),
    )  # fmt: skip
    buf, wire = bytearray(), []
    start = time.perf_counter()
    for _ in range(args.frames):
        view = sender.send_into(frame, buf)
        wire.append(bytes(view))  # what the socket would carry; outside the decode timing
        view.release()
    encode = time.perf_counter() - start
    start = time.perf_counter()
    for data in wire:
        receiver.receive_data(data)
        receiver.next_message()
    decode = time.perf_counter() - start
    per = 1e6 / args.frames
    print(f"frame bytes: {len(wire[0])} (payload {2 * args.hidden})")
    print(f"encode (send_into): {encode * per:.1f} us/frame")
    print(f"decode (receive_data + next_message): {decode * per:.1f} us/frame")
    print(f"encode + decode: {(encode + decode) * per:.1f} us/frame")


if __name__ == "__main__":
    main()
