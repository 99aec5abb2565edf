"""benchmarks/hybrid.py runs: its tiny smoke mode prints the three tables, and the n-gram
runs match plain greedy decoding (the script exits non-zero otherwise)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "hybrid.py"


def test_tiny_smoke_mode_prints_the_tables() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--repeats", "1", "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO_ROOT,
    )
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "## Verify pass of k + 1 rows" in out
    assert "| snapshot ring (copy) |" in out
    rows = [line for line in out.splitlines() if line.startswith("| period-")]
    assert len(rows) == 2
    for row in rows:
        rate = float(row.split(" | ")[3])
        assert rate > 0.5  # the repetitive prompts get their drafts accepted
