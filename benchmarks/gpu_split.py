"""A CPU+GPU split against the golden reference (issue 33): two ``meshnode join``
processes on loopback, the host's stage on the CUDA backend and the worker's on the CPU,
both in float32 with float32 activations on the wire, speculation off. Every golden
prompt is completed greedily; the text must be the golden text (what one node gives).

Run on the GPU machine (``scripts/gpu-check.sh`` does): ``python3 benchmarks/gpu_split.py``
(``--host-device cpu`` runs the same check on two CPU stages anywhere). Prints one line per
prompt and a summary; exits 1 when any prompt differs, 2 when the mesh does not come up.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.cluster import HEARTBEAT_ENV, SINGLE_THREAD_ENV, Cluster, init_token, wait_for

MODEL = "smollm2-135m"
CONTEXT = 512
READY_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 120.0
GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden" / "smollm2-135m-greedy.json"


def _ready_stages(host: Any) -> int:
    block = host.status()["host"]
    if block["state"] != "ready":
        return 0
    return sum(stage["state"] == "ready" for stage in block["stages"])


def check(host_device: str, worker_device: str) -> int:
    """Run every golden prompt through the split; the number that differ."""
    golden = json.loads(GOLDEN.read_text())
    max_tokens = int(golden["generation"]["max_new_tokens"])
    env = {**HEARTBEAT_ENV, **SINGLE_THREAD_ENV}
    with tempfile.TemporaryDirectory() as tmp, Cluster(Path(tmp), env=env) as cluster:
        token = init_token(Path(tmp) / "mesh.token")
        fp32 = ("--dtype", "float32")
        worker = cluster.spawn("w0", token, "--device", worker_device, *fp32, mdns=False)
        cluster.wait_started(worker)
        host = cluster.spawn(
            "host", token, "--peer", worker.listen, "--model", MODEL, "--split", "2",
            "--device", host_device, *fp32, "--wire-dtype", "f32", "--speculative", "off",
            "--context", str(CONTEXT), mdns=False,
        )  # fmt: skip
        cluster.wait_started(host)
        try:
            wait_for(lambda: _ready_stages(host) == 2, READY_TIMEOUT_S, "2 ready stages")
        except AssertionError as exc:
            print(f"{exc}\n{cluster.logs()}")
            return -1
        differ = 0
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
            for case in golden["prompts"]:
                body = {"model": MODEL, "prompt": case["prompt_ids"], "temperature": 0,
                        "max_tokens": max_tokens}  # fmt: skip
                began = time.perf_counter()
                reply = http.post(f"{host.api}/v1/completions", json=body)
                reply.raise_for_status()
                text = reply.json()["choices"][0]["text"]
                same = text == case["gen_text_skip_special"]
                differ += not same
                verdict = "same" if same else f"DIFFERS: {text!r}"
                print(f"{case['id']}: {verdict} ({time.perf_counter() - began:.2f} s)")
    return differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host-device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--worker-device", choices=["cuda", "cpu"], default="cpu")
    args = parser.parse_args(argv)
    differ = check(args.host_device, args.worker_device)
    if differ < 0:
        return 2
    print(f"split {args.host_device}+{args.worker_device}: {differ} prompt(s) differ from golden")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
