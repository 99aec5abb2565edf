"""Golden frames: examples of every message, written to ``protocol/vectors/<name>.json``.

(Lenient encodings and malformed streams, in ``lenient/`` and ``malformed/`` beside them,
come from :mod:`meshnode_protocol.edge_vectors`; the JSON form of a message from
:mod:`meshnode_protocol.vector_json`.)

Each vector file holds the message type, its fields in JSON form and the exact frame bytes
in hex. Tensors appear as ``{"dtype", "shape", "data_hex"}``; tuples as arrays; nested
records as objects. The tests read the files and check them both ways (decode(bytes) ==
message and encode(message) == bytes) without regenerating them. Regenerate only for a
deliberate wire change::

    python -m meshnode_protocol.vectors protocol/vectors
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any, Final

from meshnode_protocol._framing import encode_frame
from meshnode_protocol._messages import (
    ActivationBatch,
    ActivationFrame,
    Claim,
    ClaimAccepted,
    ClaimRejected,
    Error,
    Goodbye,
    Heartbeat,
    Hello,
    Inventory,
    InventoryReport,
    LinkProbe,
    LinkProbeReply,
    Load,
    Message,
    PeerInfo,
    PeerLink,
    Prediction,
    PredictionBatch,
    Prepare,
    PrepareAccepted,
    Ready,
    Release,
    Sampling,
    SpeedQuery,
    SpeedReport,
    Status,
    Stop,
    TopLogprobs,
)
from meshnode_protocol._tensor import Tensor
from meshnode_protocol.edge_vectors import LENIENT, MALFORMED, lenient_document, malformed_document
from meshnode_protocol.vector_json import to_json

_RUN_ID: Final = "run-7f3a"
_TERM: Final = 3
_HOST: Final = PeerInfo(
    node_id="node-a", address="10.0.0.1:7420", device_kind="cuda", usable_memory=8 << 30
)
_TAIL: Final = PeerInfo(node_id="node-c", address="10.0.0.3:7420", device_kind="cpu")


def _f16(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}e", *values)


def _f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


EXAMPLES: Final[dict[str, Message]] = {
    "hello": Hello(
        node_id="node-a",
        mesh_id_hash="5d41402abc4b2a76",
        listen_address="10.0.0.1:7420",
        device_kind="cuda",
        usable_memory=8 << 30,
        known_peers=(_TAIL,),
        api_address="127.0.0.1:7421",
    ),
    "goodbye": Goodbye(node_id="node-b", reason="SIGTERM"),
    "heartbeat": Heartbeat(node_id="node-a", nonce=17, sent_ns=1_000_000_123),
    "heartbeat_echo": Heartbeat(
        node_id="node-b", nonce=4, sent_ns=77, echo_nonce=17, echo_sent_ns=1_000_000_123
    ),
    "link_probe": LinkProbe(
        node_id="node-a", nonce=9, payload=Tensor(dtype="f16", shape=(4,), data=bytes(8))
    ),
    "link_probe_empty": LinkProbe(node_id="node-a", nonce=8),
    "link_probe_reply": LinkProbeReply(node_id="node-b", nonce=9, received_bytes=8),
    "speed_query": SpeedQuery(
        node_id="node-a", nonce=3, package_ref="hf://org/smollm2@main", pin="c" * 40
    ),
    "speed_query_peers": SpeedQuery(
        node_id="node-a",
        nonce=6,
        package_ref="hf://org/smollm2@main",
        peers=(
            PeerInfo(node_id="node-c", address="10.0.0.3:7470", device_kind="cpu"),
            PeerInfo(node_id="node-d", address="[fd00::4]:7470", usable_memory=1 << 31),
        ),
    ),
    "speed_report": SpeedReport(
        node_id="node-b",
        nonce=3,
        package_ref="hf://org/smollm2@main",
        layer=4,
        decode_us=812.5,
        batch_us=140.25,
        prefill_us=96.0,
        layer_bytes=3_538_944,
        disk_bytes_per_s=1.5e9,
    ),
    "speed_report_none": SpeedReport(
        node_id="node-b", nonce=4, package_ref="hf://org/smollm2@main"
    ),
    "speed_report_measuring": SpeedReport(
        node_id="node-c", nonce=6, package_ref="hf://org/smollm2@main", measuring=True
    ),
    "speed_report_links": SpeedReport(
        node_id="node-b",
        nonce=5,
        package_ref="hf://org/smollm2@main",
        links=(
            PeerLink(node_id="node-a", rtt_us=412.0, bytes_per_s=1.1e8),
            PeerLink(node_id="node-c", rtt_us=2_750.5),
        ),
    ),
    "error": Error(code=100, message="term 2 is older than 3", run_id="run-7f3a", term=2),
    "error_fatal": Error(code=1, message="bad CBOR header", fatal=True),
    "claim": Claim(
        run_id=_RUN_ID, term=_TERM, coordinator_id="node-a", package_ref="hf://org/smollm2@main"
    ),
    "claim_accepted": ClaimAccepted(
        run_id=_RUN_ID, term=_TERM, node_id="node-b", device_kind="cpu", usable_memory=4 << 30
    ),
    "claim_rejected": ClaimRejected(
        run_id=_RUN_ID,
        term=_TERM,
        node_id="node-b",
        reason="claimed by a newer term",
        held_by_run="run-80",
        held_by_term=4,
    ),
    "prepare": Prepare(
        run_id=_RUN_ID,
        term=_TERM,
        package_ref="hf://org/smollm2@main",
        manifest_sha256="ab" * 32,
        layer_range=(10, 20),
        has_embed=False,
        has_head=False,
    ),
    "prepare_pinned": Prepare(
        run_id=_RUN_ID,
        term=_TERM,
        package_ref="hf://org/smollm2:Q4_K_M",
        manifest_sha256="",
        layer_range=(0, 10),
        has_embed=True,
        has_head=False,
        commit="0123456789abcdef0123456789abcdef01234567",
    ),
    "prepare_accepted": PrepareAccepted(run_id=_RUN_ID, term=_TERM, node_id="node-b"),
    "inventory": Inventory(
        run_id=_RUN_ID, term=_TERM, package_ref="hf://org/smollm2@main", manifest_sha256="ab" * 32
    ),
    "inventory_report": InventoryReport(
        run_id=_RUN_ID,
        term=_TERM,
        node_id="node-b",
        package_ref="hf://org/smollm2@main",
        ready=((10, 14),),
        missing=((16, 20),),
        preparing=((14, 16),),
        bytes_done=1_500_000,
        bytes_total=3_000_000,
    ),
    "inventory_report_measured": InventoryReport(
        run_id=_RUN_ID,
        term=_TERM,
        node_id="node-b",
        package_ref="hf://org/smollm2@main",
        ready=((10, 20),),
        bytes_done=3_000_000,
        bytes_total=3_000_000,
        decode_us=812.5,
        batch_us=140.25,
        prefill_us=61.0,
        layer_bytes=2_216_448,
        disk_bytes_per_s=1.5e9,
        free_memory=4_294_967_296,
    ),
    "inventory_report_links": InventoryReport(
        run_id=_RUN_ID,
        term=_TERM,
        node_id="node-b",
        package_ref="hf://org/smollm2@main",
        preparing=((10, 20),),
        links=(
            PeerLink(node_id="node-a", rtt_us=412.0, bytes_per_s=1.1e8),
            PeerLink(node_id="node-c", rtt_us=850.0, bytes_per_s=2.5e5),
        ),
    ),
    "load": Load(
        run_id=_RUN_ID,
        term=_TERM,
        package_ref="hf://org/smollm2@main",
        manifest_sha256="ab" * 32,
        layer_range=(20, 30),
        has_embed=False,
        has_head=True,
        upstream=PeerInfo(node_id="node-b", address="10.0.0.2:7420"),
        downstream=_HOST,
        wire_dtype="f16",
        context_size=8192,
        batch_sizes=(1, 4),
        kv_dtype="f16",
    ),
    # A Load for a hybrid stage of a host whose largest speculative window is 8 drafts.
    "load_ring": Load(
        run_id=_RUN_ID,
        term=_TERM,
        package_ref="hf://org/qwen35@main",
        manifest_sha256="",
        layer_range=(4, 8),
        has_embed=False,
        has_head=True,
        upstream=PeerInfo(node_id="node-b", address="10.0.0.2:7420"),
        downstream=_HOST,
        context_size=4096,
        ring_slots=9,
    ),
    # A Load whose prefix-cache keys are seeded by the pipeline, not the run (issue 30).
    "load_prefix_seed": Load(
        run_id=_RUN_ID,
        term=_TERM,
        package_ref="hf://org/smollm2@main",
        manifest_sha256="",
        layer_range=(10, 20),
        has_embed=False,
        has_head=False,
        upstream=PeerInfo(node_id="node-a", address="10.0.0.1:7420"),
        downstream=PeerInfo(node_id="node-c", address="10.0.0.3:7420"),
        context_size=2048,
        prefix_seed="5f0c" * 8,
    ),
    # A Load from a host whose CPU stages compute exactly (--dtype native).
    "load_cpu_dtype": Load(
        run_id=_RUN_ID,
        term=_TERM,
        package_ref="hf://org/smollm2@main",
        manifest_sha256="",
        layer_range=(10, 20),
        has_embed=False,
        has_head=False,
        upstream=PeerInfo(node_id="node-a", address="10.0.0.1:7420"),
        downstream=PeerInfo(node_id="node-c", address="10.0.0.3:7420"),
        context_size=2048,
        kv_dtype="f32",
        cpu_dtype="native",
    ),
    "ready": Ready(
        run_id=_RUN_ID, term=_TERM, node_id="node-c", endpoint="10.0.0.3:7420", layer_range=(20, 30)
    ),
    # A stage that keeps a prefix cache of 32-position blocks.
    "ready_prefix": Ready(
        run_id=_RUN_ID,
        term=_TERM,
        node_id="node-c",
        endpoint="10.0.0.3:7420",
        layer_range=(20, 30),
        prefix_block=32,
    ),
    # A re-loaded stage that kept two cached blocks of the same pipeline (its keys'
    # chain seeded by the Load's prefix_seed), most recently used first.
    "ready_prefix_keys": Ready(
        run_id=_RUN_ID,
        term=_TERM,
        node_id="node-c",
        endpoint="10.0.0.3:7420",
        layer_range=(20, 30),
        prefix_block=16,
        prefix_seed="5f0c" * 8,
        prefix_keys=("0123456789abcdef" * 2, "fedcba9876543210" * 2),
    ),
    "stop": Stop(run_id=_RUN_ID, term=_TERM, reason="node-b failed Load"),
    "status": Status(
        node_id="node-b", state="ready", run_id=_RUN_ID, term=_TERM, layer_range=(10, 20)
    ),
    "activation_prefill": ActivationFrame(
        request_id="req-1",
        run_id=_RUN_ID,
        term=_TERM,
        kind="prefill",
        start_pos=0,
        tokens=(1, 2, 3),
        payload=Tensor("f16", (3, 2), _f16(0.5, -1.0, 2.0, 0.25, 0.0, 1.5)),
        sampling=Sampling(temperature=0.7, top_k=40, top_p=0.9, seed=1234),
        out_rows=1,
        final=True,
    ),
    # A constrained request's first frame: the grammar (a JSON schema compiled by
    # llguidance) travels once, with the position its first constrained token will take.
    "activation_prefill_grammar": ActivationFrame(
        request_id="req-2",
        run_id=_RUN_ID,
        term=_TERM,
        kind="prefill",
        start_pos=0,
        tokens=(1, 2, 3),
        payload=Tensor("f16", (3, 2), _f16(0.5, -1.0, 2.0, 0.25, 0.0, 1.5)),
        sampling=Sampling(temperature=0.0),
        grammar='{"grammars":[{"json_schema":{"type":"object"}}]}',
        grammar_start=3,
    ),
    # A new request resuming from the stages' cached prefix of 32 tokens: its first frame
    # starts at 32 and names the prefix's last block by its hash-chain key.
    "activation_prefill_resume": ActivationFrame(
        request_id="req-3",
        run_id=_RUN_ID,
        term=_TERM,
        kind="prefill",
        start_pos=32,
        tokens=(5, 6),
        payload=Tensor("f16", (2, 2), _f16(0.5, -1.0, 2.0, 0.25)),
        sampling=Sampling(temperature=0.0),
        prefix_key=bytes(range(16)).hex(),
    ),
    # A prompt's last piece on its way to stage 1, which holds no prefix and continues the
    # request from 30; stage 2 resumes it at 32 from its cached blocks (its own key): stage
    # 1 sends it the rows from 32 on.
    "activation_prefill_resume_stages": ActivationFrame(
        request_id="req-4",
        run_id=_RUN_ID,
        term=_TERM,
        kind="prefill",
        start_pos=30,
        tokens=(5, 6, 7, 8),
        payload=Tensor("f16", (4, 1), _f16(0.5, -1.0, 2.0, 0.25)),
        resume_starts=(32,),
        resume_keys=(bytes(range(16, 32)).hex(),),
    ),
    "activation_verify": ActivationFrame(
        request_id="req-1",
        run_id=_RUN_ID,
        term=_TERM,
        kind="verify",
        start_pos=3,
        tokens=(7,),
        draft_tokens=(8, 9),
        draft_probs=(1.0, 0.5),
        payload=Tensor("f32", (3, 1), _f32(1.0, 2.0, 3.0)),
        out_rows=3,
    ),
    "activation_verify_dist": ActivationFrame(
        request_id="req-2",
        run_id=_RUN_ID,
        term=_TERM,
        kind="verify",
        start_pos=5,
        tokens=(7,),
        draft_tokens=(8,),
        draft_probs=Tensor("f32", (1, 4), _f32(0.1, 0.2, 0.3, 0.4)),
        payload=Tensor("bf16", (2, 2), bytes.fromhex("803f0040404080bf")),
        out_rows=2,
    ),
    # A decode frame leaving stage 1 of three, carrying that stage's compute time.
    "activation_decode_timed": ActivationFrame(
        request_id="r0",
        run_id=_RUN_ID,
        term=_TERM,
        kind="decode",
        start_pos=9,
        tokens=(42,),
        payload=Tensor("f16", (1, 2), _f16(0.5, -1.0)),
        stage_compute_us=(2100,),
    ),
    # A decode frame asking the last stage for four MTP drafts.
    "activation_decode_mtp": ActivationFrame(
        request_id="r0",
        run_id=_RUN_ID,
        term=_TERM,
        kind="decode",
        start_pos=9,
        tokens=(42,),
        payload=Tensor("f16", (1, 2), _f16(0.5, -1.0)),
        mtp_drafts=4,
    ),
    "prediction": Prediction(
        request_id="req-1",
        run_id=_RUN_ID,
        term=_TERM,
        start_pos=4,
        accepted=2,
        tokens=(8, 9, 11),
        logprobs=None,
    ),
    "prediction_logprobs": Prediction(
        request_id="req-1",
        run_id=_RUN_ID,
        term=_TERM,
        start_pos=3,
        accepted=0,
        tokens=(5,),
        logprobs=(-0.25,),
    ),
    "prediction_top_logprobs": Prediction(
        request_id="req-1",
        run_id=_RUN_ID,
        term=_TERM,
        start_pos=6,
        accepted=1,
        tokens=(8, 11),
        logprobs=(-0.5, -1.25),
        top_logprobs=(
            TopLogprobs(token_ids=(8, 3), logprobs=(-0.5, -1.5)),
            TopLogprobs(token_ids=(11, 12, 2), logprobs=(-1.25, -1.5, -2.0)),
        ),
        compute_us=1500,
    ),
    "hello_features": Hello(
        features=("bf16", "x-not-yet-defined"),
        node_id="node-b",
        mesh_id_hash="5d41402abc4b2a76",
        listen_address="[fd00::2]:7420",
        device_kind="cpu",
        usable_memory=0,
    ),
    "activation_verify_f16_dist": ActivationFrame(
        request_id="req-3",
        run_id=_RUN_ID,
        term=_TERM,
        kind="verify",
        start_pos=12,
        tokens=(7,),
        draft_tokens=(8, 9),
        draft_probs=Tensor("f16", (2, 3), _f16(0.25, 0.5, 0.25, 0.0, 1.0, 0.0)),
        payload=Tensor("f16", (3, 1), _f16(1.0, -2.0, 0.5)),
        sampling=Sampling(temperature=0.8, min_p=0.05, repetition_penalty=1.1),
        out_rows=3,
        logprobs=True,
        top_logprobs=2,
    ),
    "heartbeat_extremes": Heartbeat(
        node_id="node-a", nonce=-(2**63), sent_ns=2**63 - 1, echo_nonce=0, echo_sent_ns=-1
    ),
    # The last of three stages: its own compute, and stage 1's copied from the frame.
    "prediction_timed": Prediction(
        request_id="r0",
        run_id=_RUN_ID,
        term=_TERM,
        start_pos=9,
        accepted=0,
        tokens=(17,),
        compute_us=1800,
        stage_compute_us=(2100,),
    ),
    # --speculative mtp: the last stage's MTP module drafted two tokens after the new one.
    "prediction_mtp_drafts": Prediction(
        request_id="r0",
        run_id=_RUN_ID,
        term=_TERM,
        start_pos=9,
        accepted=1,
        tokens=(17, 23),
        drafts=(5, 301),
    ),
    "release": Release(request_id="req-1", run_id=_RUN_ID, term=_TERM),
    "release_max_term": Release(request_id="req-1", run_id=_RUN_ID, term=2**64 - 1),
    # One step of three requests leaving stage 1: a decode row, a verify window of two drafts
    # and a new request's prefill (with its sampling), each with its own payload, in order.
    "activation_batch": ActivationBatch(
        run_id=_RUN_ID,
        term=_TERM,
        frames=(
            ActivationFrame(
                request_id="r0",
                run_id=_RUN_ID,
                term=_TERM,
                kind="decode",
                start_pos=9,
                tokens=(42,),
                payload=Tensor("f16", (1, 2), _f16(0.5, -1.0)),
                stage_compute_us=(2100,),
            ),
            ActivationFrame(
                request_id="r1",
                run_id=_RUN_ID,
                term=_TERM,
                kind="verify",
                start_pos=20,
                tokens=(7,),
                draft_tokens=(8, 9),
                payload=Tensor("f16", (3, 2), _f16(1.0, 2.0, 3.0, 0.25, 0.0, 1.5)),
                out_rows=3,
                stage_compute_us=(2100,),
            ),
            ActivationFrame(
                request_id="r2",
                run_id=_RUN_ID,
                term=_TERM,
                kind="prefill",
                start_pos=0,
                tokens=(1, 2),
                payload=Tensor("f16", (2, 2), _f16(0.0, 1.0, -2.0, 0.5)),
                sampling=Sampling(temperature=0.0),
                final=False,
                stage_compute_us=(2100,),
            ),
        ),
    ),
    # The last stage's answer to such a step: r2's prefill chunk was not final.
    "prediction_batch": PredictionBatch(
        run_id=_RUN_ID,
        term=_TERM,
        predictions=(
            Prediction(
                request_id="r0", run_id=_RUN_ID, term=_TERM, start_pos=9, accepted=0, tokens=(17,)
            ),
            Prediction(
                request_id="r1",
                run_id=_RUN_ID,
                term=_TERM,
                start_pos=20,
                accepted=1,
                tokens=(8, 30),
                compute_us=1800,
            ),
        ),
    ),
}


# -- JSON form -------------------------------------------------------------------------------


def vector_document(msg: Message) -> dict[str, Any]:
    """The JSON document stored for one golden frame."""
    return {
        "message": type(msg).__name__,
        "type": msg.TYPE,
        "fields": to_json(msg),
        "frame_hex": encode_frame(msg).hex(),
    }


def all_documents() -> dict[str, dict[str, Any]]:
    """Every vector file's relative path → its JSON document (canonical, lenient, malformed)."""
    docs = {f"{name}.json": vector_document(msg) for name, msg in EXAMPLES.items()}
    docs |= {f"lenient/{name}.json": lenient_document(v) for name, v in LENIENT.items()}
    docs |= {f"malformed/{name}.json": malformed_document(v) for name, v in MALFORMED.items()}
    return docs


def write_vectors(folder: Path) -> list[Path]:
    """Write every vector into ``folder`` (lenient/ and malformed/ below it); the paths."""
    paths = []
    for relative, doc in all_documents().items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2) + "\n")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m meshnode_protocol.vectors [FOLDER]``."""
    args = sys.argv[1:] if argv is None else argv
    folder = Path(args[0] if args else "protocol/vectors")
    for path in write_vectors(folder):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
