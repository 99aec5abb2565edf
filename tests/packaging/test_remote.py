"""Ordinary hub repos (GGUF, safetensors) opened per stage from byte ranges on a loopback hub."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from meshnode_packaging import hub
from meshnode_packaging.errors import Cancelled, MissingPart, NotFound, RefError, Unauthorized
from meshnode_packaging.hub import hub_cache_dir, listing, token_for
from meshnode_packaging.manifest import Part
from meshnode_packaging.ranged import RangeLimits
from meshnode_packaging.reference import RemotePackage
from meshnode_packaging.refs import open_ref, pin_ref, pinned_ref, resolve
from meshnode_packaging.remote import open_hub
from meshnode_packaging.sources import GGUFSource, HFFolderSource, ModelSource
from meshnode_packaging.testing import Fault, LocalHub, Request

from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage
from tests.packaging.tinymodel import write_tiny_gguf, write_tiny_hf_repo

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The bound: a stage of layers [10, 20) of a 30-layer model moves at most this share.
MAX_STAGE_SHARE = 0.40
# Served this slowly, the tiny GGUF would take a minute: a fetch that ends sooner was cancelled.
SLOW_BYTES_PER_S = 10_000
# The bound for a failure (or a cancel) to stop the other downloads.
CANCEL_WITHIN_S = 1.0
# Pieces small enough that the tiny GGUF's fetch is many requests at once.
SMALL = RangeLimits(max_piece_bytes=32 << 10, merge_gap_bytes=0, retry_backoff_s=0.01)


@pytest.fixture(scope="session")
def smol_repo(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Path:
    """A hub repo holding the real SmolLM2 GGUF (30 layers), nothing else."""
    folder = tmp_path_factory.mktemp("smol_repo")
    shutil.copyfile(smollm2_gguf, folder / GGUF_NAME)
    return folder


@pytest.fixture(scope="session")
def st_repo(tmp_path_factory: pytest.TempPathFactory, tiny_gguf_untied: Path) -> Path:
    """A 30-layer Llama as a sharded float32 safetensors repo with its own head."""
    return write_tiny_hf_repo(tmp_path_factory.mktemp("st") / "repo", tiny_gguf_untied)


@pytest.fixture
def lhub(monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalHub]:
    with LocalHub() as h:
        monkeypatch.setenv("HF_ENDPOINT", h.endpoint)
        yield h


def _weight_gets(hub: LocalHub, suffix: str) -> list[Request]:
    return [r for r in hub.requests if r.method == "GET" and r.path.endswith(suffix)]


def _forward_equal(config: ModelConfig, part: ModelSource, whole: ModelSource) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, config.hidden_size)).astype(np.float32)
    outs = []
    for src in (part, whole):
        stage = Stage(config, src, 10, 20, embed=False, head=False)
        outs.append(stage.forward(x, 0, stage.new_cache(16)))
    assert np.array_equal(outs[0], outs[1])


def test_gguf_stage_fetches_only_its_ranges(
    lhub: LocalHub, smol_repo: Path, tmp_path: Path
) -> None:
    lhub.add_repo("org/smol", smol_repo)
    src = open_ref("hf://org/smol", Part(10, 20), cache_dir=tmp_path)
    gets = _weight_gets(lhub, ".gguf")
    size = (smol_repo / GGUF_NAME).stat().st_size
    moved = sum(r.bytes_sent for r in gets)
    print(f"GGUF stage [10,20): {moved} of {size} bytes ({moved / size:.1%}), {len(gets)} GETs")
    assert moved <= MAX_STAGE_SHARE * size
    assert all(r.status == 206 for r in gets)
    names = set(src.tensor_names())
    assert "layers.10.self_attn.q_proj.weight" in names
    assert "layers.9.self_attn.q_proj.weight" not in names
    assert "embed_tokens.weight" not in names
    with pytest.raises(MissingPart):
        src.tensor("layers.20.mlp.up_proj.weight")
    whole = GGUFSource(smol_repo / GGUF_NAME)
    _forward_equal(ModelConfig.from_hf(whole.config), src, whole)
    # A second open of the same stage is served from the cache: only the API is asked.
    lhub.clear_requests()
    open_ref("hf://org/smol", Part(12, 18), cache_dir=tmp_path)
    assert _weight_gets(lhub, ".gguf") == []


def test_safetensors_stage_fetches_only_its_ranges(
    lhub: LocalHub, st_repo: Path, tmp_path: Path
) -> None:
    lhub.add_repo("org/st", st_repo)
    src = open_ref("hf://org/st", Part(10, 20), cache_dir=tmp_path)
    gets = _weight_gets(lhub, ".safetensors")
    size = sum(f.stat().st_size for f in st_repo.glob("*.safetensors"))
    moved = sum(r.bytes_sent for r in gets)
    print(
        f"safetensors stage [10,20): {moved} of {size} bytes ({moved / size:.1%}), {len(gets)} GETs"
    )
    assert moved <= MAX_STAGE_SHARE * size
    whole = HFFolderSource(st_repo)
    _forward_equal(ModelConfig.from_hf(whole.config), src, whole)


def test_first_and_last_stages_fetch_embedding_and_head(
    lhub: LocalHub, st_repo: Path, tmp_path: Path
) -> None:
    lhub.add_repo("org/st", st_repo)
    first = open_ref("hf://org/st", Part(0, 1, embed=True), cache_dir=tmp_path)
    assert {"embed_tokens.weight", "layers.0.mlp.up_proj.weight"} <= set(first.tensor_names())
    assert "lm_head.weight" not in first.tensor_names()
    last = open_ref("hf://org/st", Part(29, 30, head=True), cache_dir=tmp_path)
    assert {"norm.weight", "lm_head.weight"} <= set(last.tensor_names())
    assert "embed_tokens.weight" not in last.tensor_names()  # untied: not needed


def test_tied_head_fetches_the_embedding(lhub: LocalHub, tiny_gguf: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copyfile(tiny_gguf, repo / "tiny.Q4_1.gguf")
    lhub.add_repo("org/tied", repo)
    last = open_ref("hf://org/tied", Part(29, 30, head=True), cache_dir=tmp_path / "c")
    assert {"norm.weight", "embed_tokens.weight"} <= set(last.tensor_names())


def test_split_gguf_opens_every_shard(lhub: LocalHub, tiny_gguf: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    write_tiny_gguf(repo / "tiny.gguf", tied=True, split_max_tensors=100)
    shards = sorted(p.name for p in repo.iterdir())
    assert shards == [f"tiny-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    lhub.add_repo("org/split", repo)
    src = open_ref(f"hf://org/split/{shards[0]}", None, cache_dir=tmp_path / "c")
    whole = GGUFSource(tiny_gguf)
    assert set(src.tensor_names()) == set(whole.tensor_names())
    for name in ("embed_tokens.weight", "layers.29.mlp.down_proj.weight", "norm.weight"):
        assert np.array_equal(src.tensor(name).data, whole.tensor(name).data)
    assert src.config["tie_word_embeddings"] is True


def test_quantization_and_file_choose_the_gguf(
    lhub: LocalHub, tiny_gguf: Path, tiny_gguf_untied: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    (repo / "sub").mkdir(parents=True)
    shutil.copyfile(tiny_gguf, repo / "m-Q4_1.gguf")
    shutil.copyfile(tiny_gguf_untied, repo / "sub" / "m.Q8_0.gguf")
    lhub.add_repo("org/two", repo)
    cache = tmp_path / "c"
    with pytest.raises(RefError, match="several GGUF files"):
        open_ref("hf://org/two", Part(0, 1), cache_dir=cache)
    with pytest.raises(RefError, match="no GGUF file for quantization Q5_K_M"):
        open_ref("hf://org/two:Q5_K_M", Part(0, 1), cache_dir=cache)
    tied = open_ref("hf://org/two:q4_1", Part(29, 30, head=True), cache_dir=cache)
    assert "lm_head.weight" not in tied.tensor_names()
    untied = open_ref("hf://org/two/sub/m.Q8_0.gguf", Part(29, 30, head=True), cache_dir=cache)
    assert "lm_head.weight" in untied.tensor_names()


@pytest.mark.parametrize(
    "ref",
    [
        "hf://org/repo@../../..",
        "hf://org/repo@..",
        "hf://org/repo/../x.gguf",
        "hf://org/repo//x.gguf",
        "hf://org/../x",
        "hf://org/repo@a b",
        "hf://org/repo@main\n",  # a regex `$` let the newline through to the hub as %0A
        "hf://org/repo/x.gguf\n",
        "hf://org/repo:Q4_K_M\n",
    ],
)
def test_refs_that_could_escape_are_refused(ref: str) -> None:
    with pytest.raises(RefError):
        resolve(ref)


@pytest.mark.parametrize("check", [hub.check_commit, hub.check_revision, hub.check_repo_path])
def test_every_ref_check_matches_the_whole_string(check: Callable[[str], str]) -> None:
    assert check("a" * 40) == "a" * 40
    for tail in ("\n", "\r\n", " ", "\x00"):
        with pytest.raises(RefError):
            check("a" * 40 + tail)


def test_ref_grammar() -> None:
    assert resolve("hf://org/repo@v1.0:Q4_K_M") == RemotePackage("org/repo", "v1.0", quant="Q4_K_M")
    assert resolve("hf://org/repo/dir/m.gguf") == RemotePackage("org/repo", file="dir/m.gguf")


def test_the_host_pin_holds_when_the_branch_moves(
    lhub: LocalHub, st_repo: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    old = lhub.add_repo("org/m", st_repo)
    assert pin_ref("hf://org/m") == old
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copyfile(tiny_gguf, moved / "x.gguf")
    lhub.add_repo("org/m", moved, commit="1" * 40)  # main now points at another commit
    assert pin_ref("hf://org/m") == "1" * 40
    src = open_ref("hf://org/m", Part(0, 1, embed=True), cache_dir=tmp_path / "c", pin=old)
    assert src.config["torch_dtype"] == "float32"  # still the safetensors repo of the pin
    with pytest.raises(NotFound):
        open_ref("hf://org/m", Part(0, 1), cache_dir=tmp_path / "c", pin="2" * 40)
    with pytest.raises(RefError):
        open_ref("hf://org/m", Part(0, 1), cache_dir=tmp_path / "c", pin="../main")


def test_offline_uses_cached_ranges_only(
    lhub: LocalHub, st_repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshnode_packaging.errors import OfflineMissing

    commit = lhub.add_repo("org/st", st_repo)
    open_ref("hf://org/st", Part(10, 20), cache_dir=tmp_path)
    lhub.clear_requests()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = open_ref("hf://org/st", Part(12, 15), cache_dir=tmp_path, pin=commit)
    assert "layers.14.mlp.up_proj.weight" in src.tensor_names()
    assert open_ref("hf://org/st", Part(12, 15), cache_dir=tmp_path).config  # refs/ cached
    with pytest.raises(OfflineMissing):
        open_ref("hf://org/st", Part(25, 26), cache_dir=tmp_path, pin=commit)
    assert lhub.requests == []


def test_token_never_goes_to_plain_http_or_other_hosts(
    lhub: LocalHub, st_repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    lhub.add_repo("org/st", st_repo)
    open_ref("hf://org/st", Part(0, 2, embed=True), cache_dir=tmp_path)
    assert lhub.requests  # API, small files and ranges were all asked for...
    assert {r.authorization for r in lhub.requests} == {None}  # ...without the token
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example")
    assert token_for("https://hub.example/org/m/resolve/main/x.gguf") == "hf_secret"
    assert token_for("https://cdn.example/x.gguf") is None
    assert token_for("https://hub.example:8443/x") is None
    assert token_for("http://hub.example/x") is None


def test_a_failed_range_cancels_the_others_within_a_second(
    lhub: LocalHub, tiny_gguf: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copyfile(tiny_gguf, repo / "t.gguf")
    lhub.add_repo("org/t", repo)
    # The header comes quickly; then three slow pieces and one the hub refuses.
    lhub.inject("t.gguf", Fault(), *[Fault(bytes_per_s=SLOW_BYTES_PER_S)] * 3, Fault(status=403))
    ref = resolve("hf://org/t")
    assert isinstance(ref, RemotePackage)
    started = time.monotonic()
    with pytest.raises(Unauthorized):
        open_hub(ref, Part(0, 30, embed=True, head=True), cache_dir=tmp_path / "c", limits=SMALL)
    assert time.monotonic() - started < CANCEL_WITHIN_S + 1.0  # header and 403 included


def test_cancel_event_stops_a_fetch(lhub: LocalHub, tiny_gguf: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copyfile(tiny_gguf, repo / "t.gguf")
    lhub.add_repo("org/t", repo)
    lhub.inject("t.gguf", *[Fault(bytes_per_s=SLOW_BYTES_PER_S)] * 8)
    ref = resolve("hf://org/t")
    assert isinstance(ref, RemotePackage)
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    started = time.monotonic()
    with pytest.raises(Cancelled):
        open_hub(ref, Part(0, 30), cache_dir=tmp_path / "c", limits=SMALL, cancel=cancel)
    assert time.monotonic() - started < 0.5 + CANCEL_WITHIN_S


def test_package_write_reads_a_hub_repo(lhub: LocalHub, st_repo: Path, tmp_path: Path) -> None:
    from meshnode_packaging.validate import validate_package

    from meshnode.cli.package import WriteConfig, run_write

    commit = lhub.add_repo("org/st", st_repo)
    out = run_write(WriteConfig(source="hf://org/st", out=tmp_path / "pkg"))
    assert validate_package(out) == []
    manifest = json.loads((out / "model-package.json").read_text())
    assert manifest["model"]["source"]["repo"] == "org/st"
    assert manifest["model"]["source"]["revision"] == commit


def test_pinned_ref_keeps_the_choice_of_file() -> None:
    sha = "a" * 40
    assert pinned_ref("hf://org/m@main:Q4_K_M", sha) == f"hf://org/m@{sha}:Q4_K_M"
    assert pinned_ref("hf://org/m/d/x.gguf", sha) == f"hf://org/m@{sha}/d/x.gguf"
    assert pinned_ref("hf://org/m", "") == "hf://org/m"
    assert pinned_ref("smollm2-135m", sha) == "smollm2-135m"


def test_a_whole_weight_file_is_checked_against_the_hub_sha256(
    lhub: LocalHub, tiny_gguf: Path, tmp_path: Path
) -> None:
    from meshnode_packaging.errors import ChecksumMismatch

    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copyfile(tiny_gguf, repo / "t.gguf")
    commit = lhub.add_repo("org/t", repo)
    cache = tmp_path / "c"
    listing("org/t", commit, cache)  # the hub's sha256 of the file as it was
    data = bytearray((repo / "t.gguf").read_bytes())
    data[-1] ^= 1  # the server now serves bytes that disagree with the listed sha256
    (repo / "t.gguf").write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match="sha256"):
        open_ref("hf://org/t", None, cache_dir=cache, pin=commit)
    ranges = next(cache.rglob("t.gguf.ranges.json"))
    assert json.loads(ranges.read_text())["done"] == []  # nothing of it is trusted any more


def test_a_dropped_range_resumes_from_the_byte_it_reached(
    lhub: LocalHub, tiny_gguf: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copyfile(tiny_gguf, repo / "t.gguf")
    lhub.add_repo("org/t", repo)
    lhub.inject("t.gguf", Fault(die_after_bytes=100_000))
    src = open_ref("hf://org/t", Part(0, 30, embed=True, head=True), cache_dir=tmp_path / "c")
    gets = _weight_gets(lhub, ".gguf")
    assert [(r.range_start, r.bytes_sent) for r in gets][:2] == [
        (0, 100_000),  # the connection died here...
        (100_000, tiny_gguf.stat().st_size - 100_000),  # ...and the piece went on from it
    ]
    whole = GGUFSource(tiny_gguf)
    name = "layers.29.mlp.down_proj.weight"
    assert np.array_equal(src.tensor(name).data, whole.tensor(name).data)


def test_package_fetch_brings_a_gguf_stage(lhub: LocalHub, tiny_gguf: Path, tmp_path: Path) -> None:
    from meshnode.cli.package import FetchConfig, run_fetch

    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copyfile(tiny_gguf, repo / "t.gguf")
    commit = lhub.add_repo("org/t", repo)
    folder = run_fetch(FetchConfig("hf://org/t", Part(3, 4), tmp_path / "c"))
    assert folder.name == commit
    assert (folder / "t.gguf").stat().st_size == tiny_gguf.stat().st_size
    assert (folder / "t.gguf.ranges.json").is_file()


def test_a_file_already_whole_in_the_hub_cache_is_not_fetched(
    lhub: LocalHub, tiny_gguf: Path, tmp_path: Path
) -> None:
    from huggingface_hub import hf_hub_download

    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copyfile(tiny_gguf, repo / "t.gguf")
    commit = lhub.add_repo("org/t", repo)
    # Another Hugging Face tool downloaded the whole file into the shared cache.
    hf_hub_download(
        "org/t",
        "t.gguf",
        revision=commit,
        endpoint=lhub.endpoint,
        token=False,
        cache_dir=hub_cache_dir(),  # huggingface_hub's own default is fixed at its import
    )
    lhub.clear_requests()
    src = open_ref("hf://org/t", Part(10, 20), cache_dir=tmp_path / "c", pin=commit)
    assert _weight_gets(lhub, ".gguf") == []
    whole = GGUFSource(tiny_gguf)
    name = "layers.15.self_attn.k_proj.weight"
    assert np.array_equal(src.tensor(name).data, whole.tensor(name).data)
    # It was hashed once against the hub's sha256, and is not hashed again.
    marker = json.loads(next((tmp_path / "c").rglob("t.gguf.whole.json")).read_text())
    assert marker["verified"] == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
