"""Materializer throughput vs a plain httpx download, and stage memory vs layers loaded.

Run: ``.venv/bin/python benchmarks/materialize.py [--reps N]``. One run, side by side, on the
same loopback server (``meshnode_packaging.testing.LocalHub``) serving a package of the
default model; the two variants alternate ``N`` times (each materializer pass into an empty
cache) and the medians are compared, because one sub-second transfer on a shared 2-core
machine is mostly noise. Prints the throughput ratio (goal >= 0.9, with sha256 verification
on) and the resident memory of a process that loaded layers [0, 10) vs [0, 30).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from meshnode_packaging.fetch import Materializer
from meshnode_packaging.manifest import Manifest, Part
from meshnode_packaging.reference import RemotePackage
from meshnode_packaging.sources import default_model_path
from meshnode_packaging.testing import LocalHub
from meshnode_packaging.writer import write_package

REPO = "bench/smollm2"
PART = Part(0, 30, embed=True, head=True)  # a one-stage mesh: the biggest stage there is

_LOAD_STAGE = """
import sys, psutil
from meshnode.engine import ModelConfig, Stage
from meshnode_packaging.package import open_package
src = open_package(sys.argv[1])
end = int(sys.argv[2])
config = ModelConfig.from_hf(src.config)
before = psutil.Process().memory_info().rss
stage = Stage(config, src, 0, end, embed=True, head=end == config.num_layers)
print(before, psutil.Process().memory_info().rss)
"""


def plain_download(endpoint: str, files: list[str], out: Path) -> float:
    """Seconds to stream ``files`` to disk with a bare httpx loop (no hashing, no resume)."""
    t0 = time.perf_counter()
    with httpx.Client(timeout=60) as client:
        for rel in files:
            url = f"{endpoint}/{REPO}/resolve/main/{rel}"
            with client.stream("GET", url) as r, (out / rel.replace("/", "_")).open("wb") as f:
                r.raise_for_status()
                for chunk in r.iter_raw():
                    f.write(chunk)
    return time.perf_counter() - t0


def materialize(cache: Path) -> float:
    """Seconds to fetch ``PART`` through the materializer into an empty cache."""
    t0 = time.perf_counter()
    Materializer(cache).fetch(RemotePackage(repo=REPO), PART)
    return time.perf_counter() - t0


def stage_rss(package: Path, end: int) -> tuple[int, int]:
    """(RSS before, RSS after) loading layers [0, end) in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_STAGE, str(package), str(end)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout.split()
    return int(out[0]), int(out[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    reps = parser.parse_args().reps
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        package = root / "pkg"
        write_package(default_model_path("smollm2-135m"), package)
        m = Manifest.load(package)
        files = m.files_for(PART)
        total = sum(int(m.files[f]["size"]) for f in files)
        with LocalHub() as hub:
            hub.add_repo(REPO, package)
            os.environ["HF_ENDPOINT"] = hub.endpoint
            (root / "plain").mkdir()
            plain_download(hub.endpoint, files, root / "plain")  # warm the page cache
            plain_s, mat_s = [], []
            for rep in range(reps):
                plain_s.append(plain_download(hub.endpoint, files, root / "plain"))
                mat_s.append(materialize(root / f"cache{rep}"))
        t_plain, t_mat = statistics.median(plain_s), statistics.median(mat_s)
        mb = total / 1e6
        print(f"stage files: {len(files)}, {mb:.1f} MB, loopback, median of {reps} alternating")
        print(f"plain httpx loop : {t_plain:6.3f} s  {mb / t_plain:7.1f} MB/s")
        print(f"materializer     : {t_mat:6.3f} s  {mb / t_mat:7.1f} MB/s  (sha256 verified)")
        print(f"ratio materializer/plain throughput: {t_plain / t_mat:.2f}  (goal >= 0.9)")
        for end in (10, 30):
            before, after = stage_rss(package, end)
            print(
                f"RSS loading layers [0,{end}): {(after - before) / 1e6:7.1f} MB "
                f"(process {after / 1e6:.1f} MB)"
            )


if __name__ == "__main__":
    main()
