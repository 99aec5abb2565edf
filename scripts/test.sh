#!/usr/bin/env bash
# Installs meshnode with its test tools and runs the whole check: ruff, mypy (strict), pytest.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
scripts/install.sh test
bin=.venv/bin
"$bin/ruff" check .
"$bin/mypy"

# MESHNODE_BUSY_LOOPS=N: N processes spin beside pytest, as other work on a shared machine
# would (the suite must pass with every core busy too; issue 35). They end with the script;
# MESHNODE_BUSY_PIDS names them.
busy=()
stop_busy() {
    if [ ${#busy[@]} -gt 0 ]; then
        kill "${busy[@]}" 2>/dev/null || true
        wait "${busy[@]}" 2>/dev/null || true
    fi
}
trap stop_busy EXIT
for ((i = 0; i < ${MESHNODE_BUSY_LOOPS:-0}; i++)); do
    sh -c 'while :; do :; done' &
    busy+=("$!")
done
export MESHNODE_BUSY_PIDS="${busy[*]:-}"
"$bin/python" -m pytest "$@"
