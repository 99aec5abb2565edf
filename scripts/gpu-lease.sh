#!/usr/bin/env bash
# Sizes the two calls of a GPU check under a transfer cap (issue 33), and makes them fit.
#
# A call to the lent GPU machine carries the repo's tracked files, its untracked files that
# git does not ignore, and the ignored folders it names, 64 MiB in all. The check's two
# calls carry .whl/ with .gpu-model/a, then .gpu-model/b (scripts/gpu-wheels.sh makes
# them; scripts/gpu-check.sh says how the calls go). The tracked tree alone is ~15 MB, of
# which ~10 MB are the tiny reference models' safetensors that no GPU test reads: when a
# call would not fit, `prepare` takes them out of git's index for the lease (the files stay
# on disk, ignored through .git/info/exclude, so they do not travel), and `restore` puts
# the index and the exclude file back. Restore before committing anything.
#
#   scripts/gpu-lease.sh prepare     print each call's size; untrack the references if needed
#   scripts/gpu-lease.sh restore     undo prepare
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
# what a call may carry, less a margin (GPU_LEASE_CAP: another cap in bytes, for the tests)
cap="${GPU_LEASE_CAP:-$((64 * 1024 * 1024 - 512 * 1024))}"
exclude="$(git rev-parse --git-path info/exclude)"
begin="# gpu-lease: references out of the index (scripts/gpu-lease.sh restore)"
end="# gpu-lease: end"
references() { git ls-files 'tests/golden/moe/*.safetensors' 'tests/golden/tiny/*.safetensors'; }

bytes() { if [[ -e "$1" ]]; then du -sb "$1" | cut -f1; else echo 0; fi; }
tree_bytes() {
    git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null \
        | awk '{s += $1} END {print s + 0}'
}
report() {
    local tree first second
    tree="$(tree_bytes)"
    first=$((tree + $(bytes .whl) + $(bytes .gpu-model/a)))
    second=$((tree + $(bytes .gpu-model/b)))
    echo "tree $((tree >> 20)) MiB; first call $((first >> 20)) MiB, second $((second >> 20)) MiB" \
        "(cap $((cap >> 20)) MiB)"
    ((first <= cap && second <= cap))
}

case "${1:-}" in
prepare)
    [[ -d .whl && -d .gpu-model ]] || { echo "run scripts/gpu-wheels.sh first" >&2; exit 2; }
    if report; then
        exit 0
    fi
    mapfile -t refs < <(references)
    git rm -q --cached -- "${refs[@]}"
    { echo "$begin"; printf '/%s\n' "${refs[@]}"; echo "$end"; } >>"$exclude"
    echo "took ${#refs[@]} reference files out of the index for the lease"
    report || { echo "still over the cap" >&2; exit 1; }
    ;;
restore)
    git reset -q -- tests/golden
    sed -i "\|^$begin\$|,\|^$end\$|d" "$exclude"
    git status --short -- tests/golden
    ;;
*)
    echo "usage: scripts/gpu-lease.sh prepare | restore" >&2
    exit 2
    ;;
esac
