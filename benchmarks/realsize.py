"""Real-size CPU speed: meshnode beside llama.cpp's own benchmarks on 1B and 8B shapes.

Run: ``.venv/bin/python benchmarks/realsize.py [--shapes 1b 8b] [--variants q4_k_m q8_0
q4_0] [--threads 1 2] [--modes exact q8] [--layers N] [--rounds 3] [--tokens 32]
[--llama-bin DIR] [--every-core-free]``

The models are random-weight GGUFs of real shapes (``benchmarks/realsize_gguf.py``:
Llama-3.2-1B and Llama-3.1-8B, llama.cpp's Q4_K_M mix, Q8_0, Q4_0; SmolLM2's tokenizer,
so a 49,152-token head; cached in ``~/.cache/meshnode/realsize/``); ``--layers`` cuts
their depth. Random weights time things only: parity is checked on the real models
(``tests/engine/test_golden.py``). For each model, each meshnode mode (``exact``:
``--dtype native``; ``q8``: 8-bit activations, the CPU's default) at each thread count runs
in its own process; every round, at each thread count in turn, runs each of them once and
llama.cpp once (llama.cpp first every other round), so that a round's measurements at one
thread count run seconds apart and the drift of this shared machine's speed (10-25 % from
one minute to the next: other tenants' memory traffic) hits both engines alike. Measured,
medians over rounds:

- decode: one sequence, ``--tokens`` new tokens after a 16-token prompt (llama.cpp:
  ``llama-bench -n TOKENS``, tg);
- 8 streams: eight sequences decoded together, one row each per step (meshnode:
  ``Stage.forward_batch``; llama.cpp: ``llama-batched-bench -npl 8``), aggregate tok/s;
- prefill: a 512-token prompt (``llama-bench -p 512``, pp512);

with ratios to llama.cpp at the same threads (the median of each round's ratio, the
lowest and highest beside it from three rounds on: :func:`ratio_cell`), the weight bytes a
decode step reads times its tokens/s (GB/s), and a streaming read of 1 GiB at the same
threads: the memory wall.
Then the compute wall: the float32 FMA peak at each thread count (:func:`fma_peak`), and
the exact mode's and llama.cpp's tokens/s as multiply-adds a second (:func:`report_compute`).

llama.cpp's binaries come from ``--llama-bin`` or ``$LLAMA_BIN`` (a folder with
``llama-bench`` and ``llama-batched-bench``); without them its columns are skipped. To build
them from the sources vendored in the ``llama-cpp-python`` sdist (about 15 minutes on 2
cores): ``pip download --no-binary :all: --no-deps llama-cpp-python``, unpack, then in
``vendor/llama.cpp``: ``cmake -B build -DGGML_NATIVE=ON && cmake --build build -j2
--target llama-bench llama-batched-bench``; binaries in ``build/bin``.

meshnode's kernel threads leave cores that other processes use (``pool.CoreGauge``);
``--every-core-free`` makes them take every thread asked for, as llama.cpp does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine import MeshnodeRunner, uptime
from benchmarks.realsize_gguf import SHAPES, VARIANTS, cached_gguf

MODES = {"exact": "blocks", "q8": "q8"}  # benchmarks/engine.py's variants
PROMPT = 16  # tokens before decode
PREFILL = 512
STREAMS = 8
FLOOR_BYTES = 2**30  # the streaming read: well past the L3 of any CPU here
LLAMA_BIN_GLOB = "/work/llama/llama_cpp_python-*/vendor/llama.cpp/build/bin"


# -- the worker: one meshnode mode at one thread count, one process ----------------------


def prompt_ids(n: int, seed: int) -> np.ndarray:
    """``n`` random token ids (100 .. 39,999) from ``seed``: the prompts of these runs."""
    return np.random.default_rng(seed).integers(100, 40000, n)


def _decode(runner: MeshnodeRunner, tokens: int) -> float:
    prefill_s, decode_s, _ = runner.generate(list(prompt_ids(PROMPT, 1)), tokens + 1)
    del prefill_s
    return tokens / decode_s


def _streams(runner: MeshnodeRunner, tokens: int) -> float:
    return streams(runner, tokens)[0]


def streams(runner: MeshnodeRunner, tokens: int) -> tuple[float, list[int]]:
    """Aggregate tok/s of :data:`STREAMS` sequences decoded together for ``tokens`` steps,
    and each sequence's last token."""
    from meshnode.engine.model import BatchRow

    stage = runner.stage
    caches = [stage.new_cache(PROMPT + tokens + 1) for _ in range(STREAMS)]
    for i, cache in enumerate(caches):
        stage.forward(prompt_ids(PROMPT, 10 + i), 0, cache, out_rows=1)
    last = [7 + i for i in range(STREAMS)]
    began = time.perf_counter()
    for step in range(tokens):
        pairs = zip(last, caches, strict=True)
        rows = [BatchRow(np.array([t]), PROMPT + step, c, 1) for t, c in pairs]
        outs = stage.forward_batch(rows)
        last = [int(np.argmax(o[-1])) for o in outs]
    return STREAMS * tokens / (time.perf_counter() - began), last


def _prefill(runner: MeshnodeRunner) -> float:
    prefill_s, _, _ = runner.generate(list(prompt_ids(PREFILL, 2)), 1)
    return PREFILL / prefill_s


def worker(args: argparse.Namespace) -> None:
    """Load the model, then answer each ``round`` line on stdin with one JSON line."""
    runner = MeshnodeRunner(args.model, MODES[args.worker], args.threads)
    if args.every_core_free:
        from meshnode.engine.cpu import matrix
        from meshnode.engine.cpu.pool import CoreGauge

        matrix._pool()._gauge = CoreGauge(Path("/nonexistent/stat"))
    _decode(runner, 2)  # warm-up: kernels compiled or loaded, pages touched
    _streams(runner, 2)
    if args.prefill:
        _prefill(runner)
    print(json.dumps({"ready": True}), flush=True)
    from meshnode.engine.cpu import matrix

    pool = matrix._pool()
    for line in sys.stdin:
        if line.strip() != "round":
            break
        crowded, shared = pool.crowded, pool.posted + pool.declined
        out = {"decode": _decode(runner, args.tokens), "streams": _streams(runner, args.tokens)}
        out["prefill"] = _prefill(runner) if args.prefill else float("nan")
        if pool.crowded > crowded:  # the kernel threads' gauge (without --every-core-free)
            alone, asked = pool.crowded - crowded, pool.posted + pool.declined - shared
            print(
                f"meshnode {args.worker}, {args.threads} threads: {alone} of "
                f"{alone + asked} products this round on one thread (the core gauge: other "
                "processes used the cores)",
                file=sys.stderr,
                flush=True,
            )
        print(json.dumps(out), flush=True)


class Worker:
    """A meshnode mode's process at one thread count, driven a round at a time."""

    def __init__(
        self,
        mode: str,
        threads: int,
        model: Path,
        args: argparse.Namespace,
        *,
        script: str = __file__,
        extra: Sequence[str] | None = None,
    ) -> None:
        # ``script``: the driver whose ``--worker`` mode runs (this one, or realsize_moe's),
        # with its own ``extra`` options (None: this driver's, from ``args``)
        cmd = [sys.executable, script, "--worker", mode, "--model", str(model)]
        cmd += ["--threads", str(threads), "--tokens", str(args.tokens)]
        if extra is None:
            extra = ["--every-core-free"] if args.every_core_free else []
            extra += [] if args.no_prefill else ["--prefill"]
        cmd += extra
        self.key = (f"meshnode {mode}", threads)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()

    def _read(self) -> dict[str, float]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.key}: worker exited ({self.proc.wait()})")
        data: dict[str, float] = json.loads(line)
        return data

    def round(self) -> dict[str, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


# -- llama.cpp ----------------------------------------------------------------------------


def llama_bin(option: str | None) -> Path | None:
    """The folder with llama.cpp's benchmarks: the option, ``$LLAMA_BIN``, the lead's build."""
    for candidate in (option, os.environ.get("LLAMA_BIN")):
        if candidate:
            return Path(candidate)
    found = sorted(Path("/").glob(LLAMA_BIN_GLOB.lstrip("/")))
    return found[-1] if found and (found[-1] / "llama-bench").exists() else None


def _run(cmd: list[str]) -> list[dict[str, Any]]:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr[-2000:]}")
    text = done.stdout.strip()
    if text.startswith("["):  # llama-bench -o json
        return list(json.loads(text))
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def llama_round(
    folder: Path, model: Path, threads: int, args: argparse.Namespace, prefill: int | None = None
) -> dict[str, float]:
    """One measurement of llama.cpp's decode (tg), prefill (pp512) and 8-sequence decode."""
    bench = [str(folder / "llama-bench"), "-m", str(model), "-t", str(threads), "-r", "1"]
    if prefill is None:  # this driver's: pp512 unless --no-prefill
        prefill = 0 if args.no_prefill else PREFILL
    bench += ["-o", "json", "-n", str(args.tokens), "-p", str(prefill)]
    out = {"decode": float("nan"), "prefill": float("nan")}
    for row in _run(bench):
        out["decode" if row["n_gen"] else "prefill"] = float(row["avg_ts"])
    batched = [str(folder / "llama-batched-bench"), "-m", str(model), "-t", str(threads)]
    batched += ["-c", str(STREAMS * (PROMPT + args.tokens) + 64), "-npp", str(PROMPT)]
    batched += ["-ntg", str(args.tokens), "-npl", str(STREAMS), "--output-format", "jsonl"]
    rows = _run(batched)
    out["streams"] = float(rows[-1]["speed_tg"])
    return out


# -- the floor ----------------------------------------------------------------------------


def read_floor(threads: int, rounds: int = 5) -> float:
    """GB/s of a streaming read of :data:`FLOOR_BYTES` split between ``threads`` threads
    (the best of ``rounds``: the least disturbed)."""
    from numba import njit

    from meshnode.engine.cpu.simd import wadd, wload, wsum, wzero

    @njit(nogil=True, cache=True)
    def read(a):  # type: ignore[no-untyped-def]
        acc = wzero()
        for i in range(0, a.shape[0], 16):
            acc = wadd(acc, wload(a, i))
        return wsum(acc)

    parts = [np.ones(FLOOR_BYTES // 4 // threads, np.float32) for _ in range(threads)]
    best = float("inf")
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(rounds + 1):
            began = time.perf_counter()
            list(ex.map(read, parts))
            best = min(best, time.perf_counter() - began)
    return FLOOR_BYTES / best / 1e9


# -- the compute wall ---------------------------------------------------------------------


def fma_peak(threads: int, rounds: int = 5) -> float:
    """Billions of float32 multiply-adds a second (one a lane) of ``threads`` threads, each
    running independent FMA chains held in registers (the best of ``rounds``): what exact
    arithmetic can reach at most on this machine, as the streaming read is for the bytes.
    Twelve chains of sixteen lanes where those are one register (AVX-512), six elsewhere
    (twelve AVX2 registers, of sixteen): enough to cover the FMA latency on both ports."""
    from numba import njit

    from meshnode.engine.cpu.simd import wfma, wload, wsum, wzero
    from meshnode.engine.cpu.simd_bytes import permutes

    @njit(nogil=True, cache=True)
    def six(n, x):  # type: ignore[no-untyped-def]
        m, c = wload(x, 0), wload(x, 16)
        a0 = a1 = a2 = a3 = a4 = a5 = wzero()
        for _ in range(n):
            a0, a1, a2 = wfma(a0, m, c), wfma(a1, m, c), wfma(a2, m, c)
            a3, a4, a5 = wfma(a3, m, c), wfma(a4, m, c), wfma(a5, m, c)
        return wsum(a0) + wsum(a1) + wsum(a2) + wsum(a3) + wsum(a4) + wsum(a5)

    @njit(nogil=True, cache=True)
    def twelve(n, x):  # type: ignore[no-untyped-def]
        m, c = wload(x, 0), wload(x, 16)
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = a10 = a11 = wzero()
        for _ in range(n):
            a0, a1, a2 = wfma(a0, m, c), wfma(a1, m, c), wfma(a2, m, c)
            a3, a4, a5 = wfma(a3, m, c), wfma(a4, m, c), wfma(a5, m, c)
            a6, a7, a8 = wfma(a6, m, c), wfma(a7, m, c), wfma(a8, m, c)
            a9, a10, a11 = wfma(a9, m, c), wfma(a10, m, c), wfma(a11, m, c)
        s = wsum(a0) + wsum(a1) + wsum(a2) + wsum(a3) + wsum(a4) + wsum(a5)
        return s + wsum(a6) + wsum(a7) + wsum(a8) + wsum(a9) + wsum(a10) + wsum(a11)

    chains, kernel = (12, twelve) if permutes() else (6, six)
    x = np.full(32, 0.5, np.float32)  # a fixed point of a * 0.5 + 0.5: no overflow
    kernel(1, x)
    steps = 50_000_000  # ~0.1-0.4 s a thread
    best = float("inf")
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(rounds + 1):
            began = time.perf_counter()
            list(ex.map(lambda _: kernel(steps, x), range(threads)))
            best = min(best, time.perf_counter() - began)
    return threads * steps * chains * 16 / best / 1e9


# -- the driver ---------------------------------------------------------------------------


class Weights(NamedTuple):
    """The weights one decode step reads: every matrix, the head, not the embedding rows
    (unless the embedding is the head)."""

    nbytes: int  # as stored
    values: int  # each one multiply-add a row
    head: int  # the head's values (a prefill runs it for its last row only)


def weights(model: Path) -> Weights:
    """:class:`Weights` of the GGUF at ``model``."""
    import gguf

    reader = gguf.GGUFReader(model)
    names = {t.name for t in reader.tensors}
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    read = [t for t in reader.tensors if t.name != "token_embd.weight" or t.name == head]
    return Weights(
        sum(int(t.n_bytes) for t in read),
        sum(int(t.n_elements) for t in read),
        next(int(t.n_elements) for t in read if t.name == head),
    )


def run_model(model: Path, args: argparse.Namespace, folder: Path | None) -> None:
    workers = [Worker(m, t, model, args) for t in args.threads for m in args.modes]
    skipped = None

    def llama(t: int) -> dict[str, float] | None:
        nonlocal skipped
        if folder is None or skipped:
            return None
        try:
            return llama_round(folder, model, t, args)
        except (RuntimeError, OSError) as exc:
            skipped = str(exc)
            return None

    print(f"\n## {model.name}: start {uptime()}", flush=True)
    results = paired_rounds(workers, args.threads, args.rounds, llama)
    for w in workers:
        w.close()
    floors = {t: read_floor(t) for t in args.threads}
    read = weights(model)
    report(model, results, floors, read.nbytes)
    report_compute(results, {t: fma_peak(t) for t in args.threads}, read)
    if folder is None:
        print("\nllama.cpp: skipped (no binaries: --llama-bin DIR or $LLAMA_BIN; see --help)")
    elif skipped:
        print(f"\nllama.cpp: skipped ({skipped})")


def paired_rounds(
    workers: Sequence[Worker],
    threads: Sequence[int],
    rounds: int,
    llama: Callable[[int], dict[str, float] | None],
) -> dict[tuple[str, int], list[dict[str, float]]]:
    """Each worker's measurement every round, with llama.cpp's at each thread count
    (``llama(t)``; None: skipped) beside them: at each thread count in turn, its workers
    then llama.cpp, or llama.cpp first every other round. Keyed by (engine, threads)."""
    results: dict[tuple[str, int], list[dict[str, float]]] = {w.key: [] for w in workers}
    for r in range(rounds):
        for t in threads:
            ours = [w for w in workers if w.key[1] == t]
            ref = None if r % 2 == 0 else llama(t)
            for w in ours:
                results[w.key].append(w.round())
            if r % 2 == 0:
                ref = llama(t)
            if ref is not None:
                results.setdefault(("llama.cpp", t), []).append(ref)
        print(f"round {r + 1}/{rounds} done, {uptime()}", flush=True)
    print(f"end {uptime()}", flush=True)
    return results


def ratio_cell(
    rounds: Sequence[dict[str, float]], ref: Sequence[dict[str, float]], key: str
) -> str:
    """The median over rounds of each round's ``key`` over llama.cpp's in the same round (at
    the same threads, seconds apart: :func:`paired_rounds`), and from three rounds on the
    lowest and highest of them: how far the machine's drift moved the ratio."""
    ratios = [a[key] / b[key] for a, b in zip(rounds, ref, strict=False)]
    if not ratios or all(r != r for r in ratios):  # none, or not measured (nan)
        return "-"
    med = statistics.median(ratios)
    if len(ratios) < 3:
        return f"{med:.2f}x"
    return f"{med:.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def report(
    model: Path,
    results: dict[tuple[str, int], list[dict[str, float]]],
    floors: dict[int, float],
    nbytes: int,
) -> None:
    """One table: medians, ratios to llama.cpp at the same threads (:func:`ratio_cell`),
    decode GB/s."""
    print(f"\n{model.name}: {nbytes / 1e9:.3f} GB of weights read per decode step")
    head = ["engine", "threads", "decode tok/s", "vs llama.cpp", "GB/s (of floor)"]
    head += ["8 streams tok/s", "vs llama.cpp", "prefill tok/s", "vs llama.cpp"]
    print("| " + " | ".join(head) + " |")
    print("|---|" + "---:|" * (len(head) - 1))
    for (engine, t), rounds in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        med = {k: statistics.median(r[k] for r in rounds) for k in ("decode", "streams", "prefill")}
        ref = results.get(("llama.cpp", t))
        cells = [engine, str(t)]
        for key in ("decode", "streams", "prefill"):
            cells.append(f"{med[key]:.1f}")
            if ref is None or engine == "llama.cpp":
                cells.append("-")
            else:
                cells.append(ratio_cell(rounds, ref, key))
            if key == "decode":
                gbs = med[key] * nbytes / 1e9
                cells.append(f"{gbs:.1f} ({gbs / floors[t]:.0%})")
        print("| " + " | ".join(cells) + " |")
    floor = ", ".join(f"{t} thread(s) {gbs:.1f} GB/s" for t, gbs in floors.items())
    print(f"\nstreaming read of {FLOOR_BYTES / 2**30:.0f} GiB (the memory wall): {floor}")


def report_compute(
    results: dict[tuple[str, int], list[dict[str, float]]],
    peaks: dict[int, float],
    read: Weights,
) -> None:
    """The exact mode's weight products against the compute wall: each weight one float32
    multiply-add a row, so tokens/s times the weights multiplied per token (a prefill's
    head only for its last row) is a rate of multiply-adds, beside :func:`fma_peak` at
    the same threads. llama.cpp's rows are its tokens/s at that rate: what float32
    arithmetic would have to reach to keep up (its own is 8-bit integer). The exact
    one-row decode spends a second multiply-add a weight on decoding it (scale and
    minimum); the 8 streams share that among their rows, and a prefill among 512."""
    total, head = read.values, read.head
    per_token = {"decode": total, "streams": total, "prefill": total - head + head / PREFILL}
    print(
        "\nweight multiply-adds, billions a second (of the float32 FMA peak: "
        + ", ".join(f"{t} thread(s) {g:.1f}" for t, g in peaks.items())
        + "), exact arithmetic and llama.cpp's rate:"
    )
    head_row = ["engine", "threads", "decode", "8 streams", "prefill"]
    print("| " + " | ".join(head_row) + " |")
    print("|---|" + "---:|" * (len(head_row) - 1))
    for (engine, t), rounds in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if engine not in ("llama.cpp", "meshnode exact"):
            continue
        cells = [engine, str(t)]
        for key in ("decode", "streams", "prefill"):
            rate = statistics.median(r[key] for r in rounds) * per_token[key] / 1e9
            cells.append(f"{rate:.1f} ({rate / peaks[t]:.0%})")
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=["1b"], choices=sorted(SHAPES))
    parser.add_argument("--variants", nargs="+", default=["q4_k_m"], choices=VARIANTS)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--layers", type=int, help="cut the models to their first N layers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="decode steps per measurement")
    parser.add_argument("--no-prefill", action="store_true", help="skip the 512-token prefill")
    parser.add_argument("--llama-bin", help="folder of llama-bench, llama-batched-bench")
    parser.add_argument("--every-core-free", action="store_true")
    parser.add_argument("--write-only", action="store_true", help="write the models, no run")
    parser.add_argument("--worker", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--prefill", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.threads = args.threads[0]
        worker(args)
        return
    folder = llama_bin(args.llama_bin)
    if folder is not None and not shutil.which("llama-bench", path=str(folder)):
        folder = None
    print(f"threads {args.threads}, rounds {args.rounds}, {args.tokens} tokens, {uptime()}")
    for shape in args.shapes:
        for variant in args.variants:
            model = cached_gguf(shape, variant, args.layers)
            if not args.write_only:
                run_model(model, args, folder)


if __name__ == "__main__":
    main()
