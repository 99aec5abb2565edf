#!/usr/bin/env bash
# The CUDA extra of meshnode that matches this machine's NVIDIA driver, for install.sh
# (and so run.sh). Source it, then:
#   cuda_extra          prints cuda12 or cuda13 from the "CUDA Version: X.Y" in the header
#                       of nvidia-smi (a newer driver runs CUDA 13 builds too); prints
#                       nothing without nvidia-smi or for a driver older than CUDA 12, and
#                       meshnode then runs on the CPU exactly as before.
#   meshnode_extras E   the extras to install given E (install.sh's argument): E, plus the
#                       CUDA extra when MESHNODE_EXTRAS is unset (set it, even empty, to
#                       choose the extras yourself).
# NVIDIA_SMI names the nvidia-smi to ask (tests point it at a stand-in).

cuda_extra() {
    local smi="${NVIDIA_SMI:-nvidia-smi}" major
    command -v "$smi" >/dev/null 2>&1 || return 0
    # A driver that cannot answer (nvidia-smi fails) counts as no driver.
    major="$("$smi" 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -n 1)" \
        || major=""
    case "$major" in
        '' | *[!0-9]*) ;;
        12) echo cuda12 ;;
        *) if [ "$major" -gt 12 ]; then echo cuda13; fi ;;
    esac
}

meshnode_extras() {
    local extras="${1:-}" cuda
    if [ -z "${MESHNODE_EXTRAS+set}" ]; then
        cuda="$(cuda_extra)" || cuda=""
        if [ -n "$cuda" ]; then
            extras="${extras:+$extras,}$cuda"
        fi
    fi
    echo "$extras"
}
