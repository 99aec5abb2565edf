"""`meshnode status` text: this node, the plan with each stage's state, the peers."""

from __future__ import annotations

from typing import Any

from meshnode.cli.mesh import format_status

NODE = {
    "node_id": "aaaa",
    "device": "cpu",
    "usable_memory": 8 << 30,
    "mesh_name": "home",
    "mesh_id": "m1",
    "listen": "10.0.0.1:7470",
    "api": "127.0.0.1:8470",
}
PEER = {
    "node_id": "bbbb",
    "address": "10.0.0.2:7470",
    "device": "cpu",
    "usable_memory": 4 << 30,
    "state": "alive",
    "rtt_ms": 1.25,
    "last_seen_s_ago": 0.3,
}


def host_body(state: str) -> dict[str, Any]:
    return {
        "node": NODE,
        "peers": [PEER],
        "host": {
            "model": "smollm2-135m",
            "model_id": "smollm2-135m",
            "state": state,
            "error": "",
            "requests_in_flight": 3,
            "stages": [
                {"node_id": "aaaa", "layers": [0, 12], "embed": True, "head": False,
                 "state": "ready", "bytes_done": 1, "bytes_total": 1},
                {"node_id": "bbbb", "layers": [12, 30], "embed": False, "head": True,
                 "state": "preparing", "bytes_done": 5 << 20, "bytes_total": 10 << 20,
                 "decode_bytes_per_s": 2.5e9},
            ],
        },
    }  # fmt: skip


def test_host_status_shows_model_plan_progress_and_requests() -> None:
    text = format_status(host_body("preparing"))
    assert "serving  smollm2-135m  (preparing, 3 requests in flight)" in text
    lines = text.splitlines()
    stage_rows = [line.split() for line in lines if line.startswith(("0 ", "1 "))]
    assert stage_rows == [
        ["0", "aaaa", "0-11", "+embed", "ready", "local", "-", "-"],
        ["1", "bbbb", "12-29", "+head", "preparing", "5.0/10.0", "MiB", "2500", "MB/s", "-"],
    ]
    assert any(line.startswith("bbbb") and "alive" in line for line in lines)


def test_the_plan_shows_the_hop_into_each_stage_and_the_link_it_crosses() -> None:
    body = host_body("ready")
    stages = body["host"]["stages"]
    stages[1].update(hop_from="aaaa", hop_ms=0.5, link_mbytes_per_s=None)
    stages.append({"node_id": "cccc", "layers": [30, 30], "state": "ready", "hop_from": "bbbb",
                   "hop_ms": 1311.07, "link_mbytes_per_s": 0.05})  # fmt: skip
    rows = [line for line in format_status(body).splitlines() if line.startswith(("1 ", "2 "))]
    assert rows[0].endswith("0.50 ms from aaaa (link not measured)")
    assert rows[1].endswith("1311.07 ms from bbbb (0.050 MB/s)")


def test_worker_status_shows_its_own_stage() -> None:
    body = {
        "node": NODE,
        "peers": [],
        "run": {"coordinator": "cccc", "state": "ready", "layers": [12, 30], "run_id": "r"},
    }
    text = format_status(body)
    assert "stage    layers 12-29 for cccc  (ready)" in text
    assert text.endswith("no peers yet")


def test_host_status_says_why_the_plan_changed() -> None:
    body = host_body("ready")
    body["host"]["last_failure"] = "stage node cccc was lost"
    text = format_status(body)
    assert "last failure  stage node cccc was lost" in text
    assert "failed   " not in text  # the old label, read as "serving has stopped"
    body["host"]["last_failure"] = ""
    assert "failure" not in format_status(body)


def test_host_status_shows_the_nodes_cooling_off_after_blame() -> None:
    """A blamed node sits out of plans for a while (coordinator, Blame): the text names it
    with the time left, soonest back first; ended cool-offs and an empty map add nothing."""
    body = host_body("ready")
    body["host"]["cooling_off"] = {"cccc": 287.4, "dddd": 12.0, "eeee": 0.0}
    text = format_status(body)
    assert "cooling off  dddd 12s, cccc 4m 48s  (blamed for a stage failure" in text
    assert "eeee" not in text
    body["host"]["cooling_off"] = {}
    assert "cooling off" not in format_status(body)
    del body["host"]["cooling_off"]  # a daemon from before the field
    assert "cooling off" not in format_status(body)


def test_status_shows_the_prefix_pool_of_each_stage_here() -> None:
    body = host_body("ready")
    kv = {"sequences": 1, "prefix_blocks_used": 3, "prefix_blocks_cached": 40,
          "prefix_blocks_free": 213, "prefix_blocks_total": 256, "prefix_block_tokens": 32,
          "prefix_hit_tokens": 1280, "prefix_miss_tokens": 700}  # fmt: skip
    body["host"]["kv"] = kv
    body["run"] = {"layers": [12, 30], "coordinator": "bbbb", "state": "ready", "kv": kv}
    lines = format_status(body).splitlines()
    want = (
        "used, 40 cached, 213 free of 256 blocks (32 tokens each); "
        "1280 prompt tokens reused, 700 computed"
    )
    assert f"prefix   stage 0: 3 {want}" in lines
    assert f"prefix   stage: 3 {want}" in lines
    body["host"]["kv"] = {"sequences": 0}  # a stage without a pool (hybrid, CUDA)
    del body["run"]
    assert not any(line.startswith("prefix") for line in format_status(body).splitlines())


def test_host_status_says_what_the_placement_follows() -> None:
    body = host_body("ready")
    assert "placed" not in format_status(body)  # a daemon from before the field
    body["host"].update(placed_by="memory", calibration="failed: did not finish within 90 s")
    text = format_status(body)
    assert "placed   by memory  (calibration: failed: did not finish within 90 s)" in text
    body["host"].update(placed_by="speed", calibration="measured")
    assert "placed   by measured speed  (calibration: measured)" in format_status(body)
    assert "from disk" not in format_status(body)
    body["host"]["stages"][1]["offload_bytes"] = 300 << 20
    text = format_status(body)
    assert (
        "warning  bbbb reads 300 MiB of its layers from disk (the mesh's memory is short)" in text
    )


def test_host_status_shows_what_each_node_measured_of_itself() -> None:
    body = host_body("ready")
    body["host"]["placed_by"] = "speed"
    stages = body["host"]["stages"]
    stages[0]["self_measured"] = {
        "decode_us": 812.5, "batch8_us": 140.2, "prefill_us": 61.0, "disk_mb_s": 1500,
    }  # fmt: skip
    stages[1]["self_measured"] = {"error": "claim refused: decode_us nan is not a time"}
    lines = format_status(body).splitlines()
    assert (
        "measured aaaa  812.5 us/layer a token at decode (8 rows 140.2, prefill 61.0), "
        "disk 1500 MB/s"
    ) in lines
    assert (
        "measured bbbb  - (claim refused: decode_us nan is not a time: planned by memory)"
    ) in lines
