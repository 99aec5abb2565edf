#!/usr/bin/env bash
# Installs meshnode with its test tools and runs the whole check: ruff, mypy (strict), pytest.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
scripts/install.sh test
bin=.venv/bin
"$bin/ruff" check .
"$bin/mypy"
"$bin/python" -m pytest "$@"
