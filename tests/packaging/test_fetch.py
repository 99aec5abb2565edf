"""The materializer against a real HTTP server on loopback (the Hugging Face resolve layout)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from meshnode_packaging.errors import (
    ChecksumMismatch,
    DiskFull,
    NotFound,
    OfflineMissing,
    TransferError,
    Unauthorized,
)
from meshnode_packaging.fetch import FetchLimits, Materializer
from meshnode_packaging.manifest import MANIFEST_NAME, Manifest, Part
from meshnode_packaging.package import open_package
from meshnode_packaging.reference import RemotePackage
from meshnode_packaging.refs import open_ref, resolve
from meshnode_packaging.testing import Fault, LocalHub
from meshnode_packaging.validate import validate_package

from tests.packaging.conftest import REPO

REF = RemotePackage(repo=REPO)
FAST = FetchLimits(retry_backoff_s=0.01, timeout_s=10)
LAYER = "layers/00012.safetensors"
# The bound for a failed file to stop the other downloads of the fetch.
CANCEL_WITHIN_S = 1.0


def _fetch(cache: Path, part: Part | None, **kw: object) -> Path:
    return Materializer(cache, limits=FAST).fetch(REF, part, **kw)  # type: ignore[arg-type]


def test_fetch_transfers_only_the_stage(hub: LocalHub, tiny_package: Path, tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    folder = _fetch(tmp_path, Part(10, 20), progress=lambda d, t: seen.append((d, t)))
    m = Manifest.load(tiny_package)
    want = {f"layers/{i:05d}.safetensors" for i in range(10, 20)}
    served = {r.path for r in hub.requests}
    assert served == want | {MANIFEST_NAME}
    assert len(hub.requests) == 11  # one request per file, nothing else
    payload = sum(r.bytes_sent for r in hub.requests if r.path != MANIFEST_NAME)
    assert payload == sum(m.files[p]["size"] for p in want)
    assert seen[-1] == (payload, payload)
    assert validate_package(folder, part=Part(10, 20)) == []
    assert not (folder / "embed.safetensors").exists()
    # The engine loads a stage from this partial snapshot.
    src = open_package(folder)
    ref_src = open_package(tiny_package)
    name = "layers.12.mlp.down_proj.weight"
    assert np.array_equal(src.tensor(name).data, ref_src.tensor(name).data)


def test_first_and_last_stage_parts(hub: LocalHub, tmp_path: Path) -> None:
    _fetch(tmp_path / "a", Part(0, 1, embed=True))
    assert {r.path for r in hub.requests} == {
        MANIFEST_NAME,
        "embed.safetensors",
        "tokenizer.json",
        "layers/00000.safetensors",
    }
    hub.clear_requests()
    _fetch(tmp_path / "b", Part(29, 30, head=True))
    # The tiny model's head is tied: the last stage needs the embedding matrix as well.
    assert {r.path for r in hub.requests} == {
        MANIFEST_NAME,
        "embed.safetensors",
        "layers/00029.safetensors",
        "head.safetensors",
        "tokenizer.json",  # for grammars (constrained decoding)
    }


def test_second_fetch_is_served_from_the_cache(hub: LocalHub, tmp_path: Path) -> None:
    _fetch(tmp_path, Part(10, 20))
    hub.clear_requests()
    _fetch(tmp_path, Part(10, 20))
    assert [r.path for r in hub.requests] == [MANIFEST_NAME]


def test_interrupted_transfer_resumes_with_range(
    hub: LocalHub, tiny_package: Path, tmp_path: Path
) -> None:
    size = (tiny_package / LAYER).stat().st_size
    hub.inject(LAYER, Fault(die_after_bytes=5000))
    _fetch(tmp_path, Part(12, 13))
    tries = [r for r in hub.requests if r.path == LAYER]
    assert [(r.status, r.range_start, r.bytes_sent) for r in tries] == [
        (200, 0, 5000),
        (206, 5000, size - 5000),
    ]
    assert validate_package(tmp_path / "models--org--tiny/snapshots/main", part=Part(12, 13)) == []


def test_partial_file_left_by_a_crash_is_resumed(
    hub: LocalHub, tiny_package: Path, tmp_path: Path
) -> None:
    entry = Manifest.load(tiny_package).files[LAYER]
    blobs = tmp_path / "models--org--tiny" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{entry['sha256']}.incomplete").write_bytes((tiny_package / LAYER).read_bytes()[:700])
    _fetch(tmp_path, Part(12, 13))
    (req,) = [r for r in hub.requests if r.path == LAYER]
    assert (req.status, req.range_start) == (206, 700)


def test_server_dying_every_time_is_a_transfer_error(hub: LocalHub, tmp_path: Path) -> None:
    hub.inject(LAYER, *[Fault(die_after_bytes=100)] * FAST.max_attempts)
    with pytest.raises(TransferError, match=LAYER):
        _fetch(tmp_path, Part(12, 13))
    snapshot = tmp_path / "models--org--tiny/snapshots/main"
    assert not (snapshot / LAYER).exists()  # a partial file is never visible


def test_corrupt_cached_file_is_detected_and_fetched_again(hub: LocalHub, tmp_path: Path) -> None:
    folder = _fetch(tmp_path, Part(12, 13))
    blob = (folder / LAYER).resolve()
    data = bytearray(blob.read_bytes())
    data[100] ^= 1
    blob.write_bytes(bytes(data))
    hub.clear_requests()
    _fetch(tmp_path, Part(12, 13))
    assert [r.path for r in hub.requests] == [MANIFEST_NAME, LAYER]
    assert validate_package(folder, part=Part(12, 13)) == []


def test_server_with_wrong_bytes_is_a_checksum_mismatch(
    hub: LocalHub, tiny_package: Path, tmp_path: Path
) -> None:
    path = tiny_package / LAYER
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))  # the server now serves bytes that disagree with its manifest
    with pytest.raises(ChecksumMismatch, match="twice"):
        _fetch(tmp_path, Part(12, 13))
    assert [r.path for r in hub.requests].count(LAYER) == 2  # one retry, then the error
    assert not any(tmp_path.rglob("*.incomplete"))


def test_404_and_401(hub: LocalHub, tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="404"):
        Materializer(tmp_path, limits=FAST).fetch(RemotePackage(repo="org/absent"), Part(0, 1))
    hub.inject(MANIFEST_NAME, Fault(status=401))
    with pytest.raises(Unauthorized, match="HF_TOKEN"):
        _fetch(tmp_path, Part(0, 1))
    hub.inject(LAYER, Fault(status=403))
    with pytest.raises(Unauthorized, match="403"):
        _fetch(tmp_path, Part(12, 13))


def test_token_never_goes_to_a_plain_http_host(
    hub: LocalHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_test")  # read at call time, not import time
    _fetch(tmp_path, Part(3, 4))
    url_ref = resolve(f"{hub.endpoint}/org/tiny/resolve/main")
    assert isinstance(url_ref, RemotePackage)
    Materializer(tmp_path / "u", limits=FAST).fetch(url_ref, Part(5, 6))
    assert len(hub.requests) == 4
    assert {r.authorization for r in hub.requests} == {None}


def test_offline_uses_the_cache_or_says_what_is_missing(
    hub: LocalHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fetch(tmp_path, Part(10, 20))
    hub.clear_requests()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = _fetch(tmp_path, Part(12, 14))
    assert hub.requests == []
    assert open_package(folder).tensor("layers.13.mlp.up_proj.weight").dtype == "Q4_1"
    with pytest.raises(OfflineMissing, match="layers/00025"):
        _fetch(tmp_path, Part(25, 26))
    with pytest.raises(OfflineMissing, match=MANIFEST_NAME):
        _fetch(tmp_path / "empty", Part(0, 1))


def test_disk_full_before_any_download(hub: LocalHub, tmp_path: Path) -> None:
    limits = FetchLimits(reserve_free_bytes=1 << 62)  # more than any disk has
    with pytest.raises(DiskFull, match="free"):
        Materializer(tmp_path, limits=limits).fetch(REF, Part(0, 1))
    assert [r.path for r in hub.requests] == [MANIFEST_NAME]


def test_pinned_manifest_hash(hub: LocalHub, tiny_package: Path, tmp_path: Path) -> None:
    with pytest.raises(ChecksumMismatch, match="pinned"):
        _fetch(tmp_path, Part(0, 1), manifest_sha256="0" * 64)
    good = hashlib.sha256((tiny_package / MANIFEST_NAME).read_bytes()).hexdigest()
    assert _fetch(tmp_path, Part(0, 1), manifest_sha256=good).is_dir()


def test_moved_revision_drops_stale_links(
    hub: LocalHub, tiny_package: Path, tmp_path: Path
) -> None:
    folder = _fetch(tmp_path, Part(12, 13))
    # Publish a new revision under the same name: layer 12's bytes and hash change.
    path = tiny_package / LAYER
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    manifest = json.loads((tiny_package / MANIFEST_NAME).read_text())
    manifest["files"][LAYER]["sha256"] = hashlib.sha256(data).hexdigest()
    (tiny_package / MANIFEST_NAME).write_text(json.dumps(manifest))
    _fetch(tmp_path, Part(0, 1))  # another stage: layer 12's old link must not survive
    assert not (folder / LAYER).exists()
    _fetch(tmp_path, Part(12, 13))
    assert validate_package(folder, part=Part(12, 13)) == []


def test_two_processes_fetching_the_same_files(hub: LocalHub, tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path;"
        "from meshnode_packaging.fetch import Materializer;"
        "from meshnode_packaging.manifest import Part;"
        "from meshnode_packaging.reference import RemotePackage;"
        "Materializer(Path(sys.argv[1])).fetch(RemotePackage('org/tiny'), Part(0, 30, True, True))"
    )
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env) for _ in range(2)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    assert validate_package(tmp_path / "models--org--tiny/snapshots/main") == []
    # Each file was downloaded once: the second process waited on the lock, then hit the cache.
    files = [r.path for r in hub.requests if r.path != MANIFEST_NAME]
    assert len(files) == len(set(files)) == 33


def test_open_ref_materializes_a_stage(hub: LocalHub, tmp_path: Path) -> None:
    src = open_ref("hf://org/tiny@main", Part(5, 6), cache_dir=tmp_path)
    assert {n for n in src.tensor_names() if n.startswith("layers.")} == {
        f"layers.5.{k}"
        for k in [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ]
    }
    url_ref = resolve(f"{hub.endpoint}/org/tiny/resolve/main")
    assert isinstance(url_ref, RemotePackage)
    src = open_ref(url_ref, Part(7, 8), cache_dir=tmp_path)
    assert src.tensor("layers.7.mlp.up_proj.weight").shape == (128, 64)


def test_a_failed_file_cancels_the_other_downloads(hub: LocalHub, tmp_path: Path) -> None:
    # Three files served slowly enough to take minutes, and one the hub refuses.
    slow = [f"layers/{i:05d}.safetensors" for i in (10, 11, 12)]
    for path in slow:
        hub.inject(path, Fault(bytes_per_s=2_000))
    hub.inject("layers/00013.safetensors", Fault(status=403))
    started = time.monotonic()
    with pytest.raises(Unauthorized):
        _fetch(tmp_path, Part(10, 14))
    assert time.monotonic() - started < CANCEL_WITHIN_S + 1.0  # manifest and the 403 included
