"""Split-serving benchmark (issue 5): one greedy workload on 1, 2 and 3 pipeline stages.

Run: ``.venv/bin/python benchmarks/split.py [--stages 1 2 3] [--repeat 2] [--wire-dtype f16]``

For every stage count a fresh mesh of that many ``meshnode join`` processes is started on
loopback (``--split N``, speculation off, one BLAS thread per process), and the golden
prompts (token ids, temperature 0, ``max_tokens`` 48) are streamed one request at a time,
``--repeat`` times after one warm-up request. Printed per configuration:

- decode tokens/s: (tokens − 1) / (last token − first token) per stream, total over streams;
- time to first token (median);
- wire bytes per token per boundary: the encoded decode ``ActivationFrame`` (what each
  stage boundary carries per generated token) and its overhead beyond the activation, plus
  the ``Prediction`` the last stage sends back to the host;
- compute vs wire time per pipeline pass from the host's ``/metrics`` (compute is the
  host's and the last stage's; a middle stage's compute counts as "wire" there);
- greedy tokens that differ from the golden (float32) reference — with f16 activations a
  near tie can flip (issue 5 asks how often);
- ratios of decode tokens/s to the 1-stage run (goals: 2 stages ≥ 0.95, 3 stages ≥ 0.90).

All stages share this machine's cores: a split here adds wire work and context switches
without adding compute, so the ratios are a lower bound on what separate machines give.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshnode_protocol import Connection, Hello, Role

from meshnode.engine.sampling import SamplingParams
from meshnode.node.pipeline import FrameKind, RequestId, StepFrame, StepResult
from meshnode.node.wire import WireSequences, frame_to_wire, result_to_wire
from tests.e2e.cluster import (
    HEARTBEAT_ENV,
    SINGLE_THREAD_ENV,
    Cluster,
    Node,
    init_token,
    wait_for,
)

MODEL = "smollm2-135m"
HIDDEN = 576  # SmolLM2-135M
CONTEXT = 512
MAX_TOKENS = 48
READY_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 120.0
GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden" / "smollm2-135m-greedy.json"


@dataclass
class Stream:
    ttft_s: float
    decode_tokens: int  # tokens after the first
    decode_s: float
    text: str


@dataclass
class ConfigRun:
    stages: int
    streams: list[Stream] = field(default_factory=list)
    compute_s: float = 0.0
    wire_s: float = 0.0
    passes: int = 0
    differing_prompts: list[str] = field(default_factory=list)

    @property
    def decode_tps(self) -> float:
        return sum(s.decode_tokens for s in self.streams) / sum(s.decode_s for s in self.streams)

    @property
    def ttft_ms(self) -> float:
        return 1000 * statistics.median(s.ttft_s for s in self.streams)


def _ready_stages(host: Node) -> int:
    block = host.status()["host"]
    if block["state"] != "ready":
        return 0
    return sum(stage["state"] == "ready" for stage in block["stages"])


def start_mesh(cluster: Cluster, root: Path, stages: int, wire_dtype: str) -> Node:
    token = init_token(root / "mesh.token")
    workers = [cluster.spawn(f"w{i}", token, mdns=False) for i in range(1, stages)]
    cluster.wait_started(*workers)
    peers = [arg for w in workers for arg in ("--peer", w.listen)]
    host = cluster.spawn(
        "host",
        token,
        *peers,
        "--model", MODEL,
        "--split", str(stages),
        "--context", str(CONTEXT),
        "--wire-dtype", wire_dtype,
        "--speculative", "off",
        mdns=False,
    )  # fmt: skip
    cluster.wait_started(host)
    wait_for(lambda: _ready_stages(host) == stages, READY_TIMEOUT_S, f"{stages} stages")
    return host


def stream_one(http: httpx.Client, host: Node, prompt_ids: list[int]) -> Stream:
    body = {
        "model": MODEL,
        "prompt": prompt_ids,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    began = time.perf_counter()
    stamps: list[float] = []
    text = []
    with http.stream("POST", f"{host.api}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            for choice in event.get("choices", []):
                if choice.get("text"):
                    stamps.append(time.perf_counter())
                    text.append(choice["text"])
    # Text chunks approximate tokens (the detokenizer may hold a partial character back).
    return Stream(stamps[0] - began, len(stamps) - 1, stamps[-1] - stamps[0], "".join(text))


def metric_sums(http: httpx.Client, host: Node) -> dict[str, float]:
    sums: dict[str, float] = {}
    for line in http.get(f"{host.api}/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name in {
            "meshnode_stage_compute_seconds_sum",
            "meshnode_stage_compute_seconds_count",
            "meshnode_wire_seconds_sum",
        }:
            sums[name] = float(value)
    return sums


def run_config(stages: int, prompts: list[dict[str, Any]], args: argparse.Namespace) -> ConfigRun:
    env = {**HEARTBEAT_ENV, **SINGLE_THREAD_ENV}
    with tempfile.TemporaryDirectory() as tmp, Cluster(Path(tmp), env=env) as cluster:
        try:
            host = start_mesh(cluster, Path(tmp), stages, args.wire_dtype)
        except AssertionError as exc:
            raise SystemExit(f"{exc}\n{cluster.logs()}") from exc
        run = ConfigRun(stages)
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
            stream_one(http, host, prompts[0]["prompt_ids"])  # warm-up
            before = metric_sums(http, host)
            for _ in range(args.repeat):
                for case in prompts:
                    stream = stream_one(http, host, case["prompt_ids"])
                    run.streams.append(stream)
                    if stream.text != case["gen_text_skip_special"]:
                        run.differing_prompts.append(case["id"])
            after = metric_sums(http, host)
        key = "meshnode_stage_compute_seconds"
        run.compute_s = after.get(f"{key}_sum", 0) - before.get(f"{key}_sum", 0)
        run.passes = int(after.get(f"{key}_count", 0) - before.get(f"{key}_count", 0))
        run.wire_s = after.get("meshnode_wire_seconds_sum", 0) - before.get(
            "meshnode_wire_seconds_sum", 0
        )
        return run


def decode_frame_bytes(wire_dtype: str) -> tuple[int, int, int]:
    """(decode ActivationFrame bytes, its overhead beyond the activation, Prediction bytes)."""
    dialer, listener = Connection(Role.DIALER), Connection(Role.LISTENER)
    hello = Hello(node_id="0" * 16, mesh_id_hash="0" * 32, listen_address="127.0.0.1:7470",
                  device_kind="cpu", usable_memory=1)  # fmt: skip
    listener.receive_data(dialer.send(hello))
    listener.next_message()
    dialer.receive_data(listener.send(hello))
    dialer.next_message()
    request = RequestId("r12")  # RemotePipeline's per-run wire id of a sequence
    frame = StepFrame(request, FrameKind.DECODE, 300, (12345,), SamplingParams(temperature=0))
    hidden = np.zeros((1, HIDDEN), np.float32)
    message = frame_to_wire(frame, hidden, run_id="run-0123abcd", term=1,
                            wire_dtype=wire_dtype, sequences=WireSequences(1))  # fmt: skip
    size = len(dialer.send(message))
    payload = 0 if message.payload is None else message.payload.nbytes
    result = StepResult(request, tokens=(12345,), compute_s=0.01)
    prediction = result_to_wire(result, run_id="run-0123abcd", term=1, start_pos=300)
    return size, size - payload, len(listener.send(prediction))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--wire-dtype", choices=["f16", "f32"], default="f16")
    args = parser.parse_args()
    prompts: list[dict[str, Any]] = json.loads(GOLDEN.read_text())["prompts"]

    runs = [run_config(n, prompts, args) for n in args.stages]
    frame, overhead, prediction = decode_frame_bytes(args.wire_dtype)
    base = next((r.decode_tps for r in runs if r.stages == 1), None)
    print(f"wire dtype {args.wire_dtype}; {len(prompts)} golden prompts x {args.repeat}, "
          f"max_tokens {MAX_TOKENS}, greedy, streaming, one request at a time")  # fmt: skip
    print(f"decode frame per boundary per token: {frame} B ({overhead} B beyond the "
          f"activation); Prediction back to the host: {prediction} B")  # fmt: skip
    header = ("stages", "decode tok/s", "vs 1 stage", "TTFT ms", "B/token/boundary",
              "compute ms/pass", "wire ms/pass", "prompts != golden")  # fmt: skip
    print(" | ".join(header))
    for run in runs:
        passes = max(run.passes, 1)
        ratio = "-" if base is None else f"{run.decode_tps / base:.3f}"
        differing = sorted(set(run.differing_prompts))
        boundary = "-" if run.stages == 1 else str(frame)
        print(" | ".join([
            str(run.stages),
            f"{run.decode_tps:.1f}",
            ratio,
            f"{run.ttft_ms:.0f}",
            boundary,
            f"{1000 * run.compute_s / passes:.1f}",
            f"{1000 * run.wire_s / passes:.1f}",
            f"{len(differing)}/{len(prompts)} {' '.join(differing)}",
        ]))  # fmt: skip


if __name__ == "__main__":
    main()
