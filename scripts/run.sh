#!/usr/bin/env bash
# Installs meshnode (scripts/install.sh) and runs `meshnode ARGS...`.
# MESHNODE_EXTRAS: the extras to install; unset, install.sh picks the CUDA extra matching
# the NVIDIA driver, if any (scripts/cuda_extra.sh).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/install.sh" "${MESHNODE_EXTRAS:-}"
exec "$root/.venv/bin/meshnode" "$@"
