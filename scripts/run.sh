#!/usr/bin/env bash
# Installs meshnode (scripts/install.sh) and runs `meshnode ARGS...`.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/install.sh" "${MESHNODE_EXTRAS:-}"
exec "$root/.venv/bin/meshnode" "$@"
