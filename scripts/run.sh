#!/usr/bin/env bash
# Installs meshnode (scripts/install.sh) and runs `meshnode ARGS...`. A repeat start skips
# the install when nothing it is made from changed (install.sh --if-changed); delete .venv
# (or its meshnode-install.sha256) to force one.
# MESHNODE_EXTRAS: the extras to install; unset, install.sh picks the CUDA extra matching
# the NVIDIA driver, if any (scripts/cuda_extra.sh).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/install.sh" --if-changed "${MESHNODE_EXTRAS:-}"
exec "$root/.venv/bin/meshnode" "$@"
