"""Speculative decoding benchmark (issue 6): strategies × prompt sets × single node / two stages.

Run: ``.venv/bin/python benchmarks/speculative.py [--configs single two] [--runs 3]
[--max-tokens 128] [--sweep-layers 15 20 24 27]``

For every configuration (``single``: one ``meshnode join --model`` process; ``two``: a
host and a worker process on loopback with ``--split 2``) one mesh per strategy (baseline =
``--speculative off``, ``ngram-auto``, layer-skip drafting with a fixed and an adaptive
window) is started, one after the other. The prompt sets are then sent through the OpenAI API
(greedy, non-streaming, one request at a time, meshes taking turns so that the shared
machine's load drifts over all of them alike) ``--runs`` times, and the median run is
reported: completion tokens per second of wall time, the wall time of the set, the accept
rate (accepted / proposed drafts, from the responses' ``meshnode.speculation`` field), and
the ratio of tokens/s to the same configuration's baseline. Every greedy reply is checked
against the baseline's: speculation must not change a token.

Sets: ``chat`` — short open questions (drafts rarely match); ``code`` — code-editing
requests whose answer copies most of the prompt (n-gram lookups shine). Replies run to
their end of turn or ``--max-tokens``.

A last table sweeps the layer count of the layer-skip drafter in this process (single node,
the API's generation loop through ``meshnode.serve.local.generate_tokens``, adaptive
window): tokens/s, accept rate and ratio to plain decoding per set, from which
``DEFAULT_LAYER_SKIP_FRACTION`` is chosen.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.cluster import (
    SINGLE_THREAD_ENV,
    Cluster,
    Node,
    init_token,
    wait_for,
)

MODEL = "smollm2-135m"
CONTEXT = 1024
READY_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 300.0
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

CHAT = [
    "What is the capital of France?",
    "Explain what a hash table is in two sentences.",
]
_CODE = """def add(a, b):
    # add two numbers and return the result
    result = a + b
    return result

print(add(1, 2))
print(add(10, 20))
print(add(100, 200))
"""
_CLASS = """class Counter:
    def __init__(self):
        self.count = 0

    def increment(self):
        self.count = self.count + 1
        return self.count

    def reset(self):
        self.count = 0
"""
CODE = [
    "Repeat this code exactly, changing only the function name from add to plus. "
    f"Output only the code.\n\n{_CODE}",
    f"Rename the class Counter to Tally in this code. Output only the code.\n\n{_CLASS}",
]
SETS = {"chat": CHAT, "code": CODE}

STRATEGIES: dict[str, list[str]] = {
    "baseline": ["--speculative", "off"],
    "ngram-auto": ["--speculative", "auto"],
    "layer-skip fixed": [
        "--speculative", "layer-skip", "--window-policy", "fixed", "--initial-window", "3",
    ],
    "layer-skip adaptive": [
        "--speculative", "layer-skip", "--window-policy", "adaptive",
        "--initial-window", "3", "--min-window", "1", "--max-window", "8",
    ],
}  # fmt: skip


@dataclass
class SetRun:
    """One pass over a prompt set."""

    wall_s: float
    tokens: int
    proposed: int
    accepted: int
    texts: list[str]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def _ready_stages(host: Node) -> int:
    block = host.status()["host"]
    if block["state"] != "ready":
        return 0
    return sum(stage["state"] == "ready" for stage in block["stages"])


def _serving(host: Node, stages: int) -> Callable[[], bool]:
    return lambda: _ready_stages(host) == stages


def start_mesh(cluster: Cluster, root: Path, name: str, stages: int, flags: list[str]) -> Node:
    """Start the nodes of one mesh (not waiting for it to serve); its host."""
    token = init_token(root / f"{name}.token")
    peers: list[str] = []
    if stages == 2:
        worker = cluster.spawn(f"{name}-worker", token, mdns=False)
        cluster.wait_started(worker)
        peers = ["--peer", worker.listen, "--split", "2"]
    return cluster.spawn(
        f"{name}-host",
        token,
        *peers,
        "--model", MODEL,
        "--context", str(CONTEXT),
        *flags,
        mdns=False,
    )  # fmt: skip


def run_set(http: httpx.Client, host: Node, prompts: list[str], max_tokens: int) -> SetRun:
    tokens = proposed = accepted = 0
    texts = []
    began = time.perf_counter()
    for prompt in prompts:
        body = {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": prompt},
            ],
            "temperature": 0,
            "max_tokens": max_tokens,
        }
        response = http.post(host.api + "/v1/chat/completions", json=body)
        response.raise_for_status()
        reply: dict[str, Any] = response.json()
        tokens += reply["usage"]["completion_tokens"]
        spec = reply["meshnode"]["speculation"]
        proposed += spec["proposed"]
        accepted += spec["accepted"]
        texts.append(reply["choices"][0]["message"]["content"])
    return SetRun(time.perf_counter() - began, tokens, proposed, accepted, texts)


def measure(config: str, runs: int, max_tokens: int) -> dict[str, dict[str, SetRun]]:
    """The median run of every set for every strategy of one configuration."""
    stages = 2 if config == "two" else 1
    # Default heartbeat timeouts: eight processes loading at once on two cores miss the
    # short test timeouts, and a lost peer would abandon a run mid-benchmark.
    env = dict(SINGLE_THREAD_ENV) if stages == 2 else {}
    with tempfile.TemporaryDirectory(prefix="bench-spec-") as tmp:
        root = Path(tmp)
        with Cluster(root, env=env) as cluster, httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
            hosts = {}
            try:
                for index, (strategy, flags) in enumerate(STRATEGIES.items()):
                    host = start_mesh(cluster, root, f"m{index}", stages, flags)
                    cluster.wait_started(host)
                    wait_for(_serving(host, stages), READY_TIMEOUT_S, f"{host.name} to serve")
                    hosts[strategy] = host
            except AssertionError as exc:
                raise SystemExit(f"{exc}\n{cluster.logs()}") from exc
            for host in hosts.values():
                run_set(http, host, CHAT[:1], 4)  # warm-up: first-request allocations
            samples: dict[tuple[str, str], list[SetRun]] = {}
            for _ in range(runs):
                for name, prompts in SETS.items():
                    for strategy, host in hosts.items():
                        sample = run_set(http, host, prompts, max_tokens)
                        samples.setdefault((strategy, name), []).append(sample)
    result: dict[str, dict[str, SetRun]] = {}
    for (strategy, name), runs_of in samples.items():
        runs_of.sort(key=lambda s: s.wall_s)
        result.setdefault(strategy, {})[name] = runs_of[len(runs_of) // 2]
    return result


def table(results: dict[tuple[str, str], dict[str, SetRun]], configs: list[str]) -> str:
    lines = [
        "| config | strategy | set | tokens/s | wall s | accept rate | × baseline |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for config in configs:
        for strategy in STRATEGIES:
            for name in SETS:
                run = results[(config, strategy)][name]
                base = results[(config, "baseline")][name]
                rate = f"{run.accepted / run.proposed:.0%}" if run.proposed else "-"
                lines.append(
                    f"| {config} | {strategy} | {name} | {run.tokens_per_s:.1f} | "
                    f"{run.wall_s:.2f} | {rate} | {run.tokens_per_s / base.tokens_per_s:.2f} |"
                )
    return "\n".join(lines)


def sweep_layer_skip(layer_counts: list[int], runs: int, max_tokens: int) -> str:
    """Layer-skip drafting with each layer count against plain decoding, in this process."""
    from meshnode.engine.backend import cpu_backend
    from meshnode.engine.loader import load_model
    from meshnode.engine.sampling import SamplingParams
    from meshnode.generation.records import Speculation
    from meshnode.serve.local import generate_tokens
    from meshnode.speculative.draft import StageProposer, layer_skip_stage
    from meshnode.speculative.proposer import EMPTY_PROPOSAL, Proposal
    from meshnode.speculative.window import StepCosts, WindowPolicy

    class Plain:
        def propose(self, history: Any, max_tokens: int) -> Proposal:
            return EMPTY_PROPOSAL

        def on_result(self, proposed: int, accepted: int, *, seconds: float | None = None) -> None:
            return None

    model = load_model(MODEL, cpu_backend())
    assert model.chat_template is not None
    greedy = SamplingParams(temperature=0.0)
    window = WindowPolicy("adaptive", initial_window=3, min_window=1, max_window=8)
    prompts = {
        name: [
            model.tokenizer.encode(
                model.chat_template.render(
                    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}]
                )
            )
            for p in texts
        ]
        for name, texts in SETS.items()
    }
    drafters = {0: None, **{n: layer_skip_stage(model.stage, n) for n in layer_counts}}
    lines = [
        "| layer-skip layers | set | tokens/s | accept rate | × plain |",
        "|---:|---|---:|---:|---:|",
    ]
    for name, encoded in prompts.items():
        rates: dict[int, tuple[float, float]] = {}
        plain_replies: list[list[int]] = []
        for layers, drafter in drafters.items():
            costs = StepCosts()
            samples = []
            for _ in range(runs):
                tokens = proposed = accepted = 0
                began = time.perf_counter()
                for j, ids in enumerate(encoded):
                    proposer = Plain() if drafter is None else StageProposer(drafter, greedy, 2048)
                    run = generate_tokens(
                        model.stage, ids, greedy, max_new_tokens=max_tokens,
                        speculation=Speculation.of(proposer, window, costs=costs),
                        eos_ids=model.config.eos_token_ids,
                    )  # fmt: skip
                    if drafter is None:
                        plain_replies.append(run.state.tokens)
                    elif run.state.tokens != plain_replies[j]:
                        raise SystemExit(f"GREEDY MISMATCH: layer-skip {layers} on {name}")
                    tokens += len(run.state.tokens)
                    proposed += run.spec.proposed
                    accepted += run.spec.accepted
                samples.append((tokens / (time.perf_counter() - began), proposed, accepted))
            samples.sort()
            speed, proposed, accepted = samples[len(samples) // 2]
            rates[layers] = (speed, accepted / proposed if proposed else 0.0)
        for layers, (speed, rate) in rates.items():
            label = "plain" if layers == 0 else str(layers)
            ratio = speed / rates[0][0]
            lines.append(f"| {label} | {name} | {speed:.1f} | {rate:.0%} | {ratio:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--configs", nargs="*", choices=["single", "two"], default=["single", "two"]
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--sweep-layers", nargs="*", type=int, default=[15, 20, 24, 27],
        help="layer counts for the in-process layer-skip sweep (none: skip it)",
    )  # fmt: skip
    args = parser.parse_args()
    results: dict[tuple[str, str], dict[str, SetRun]] = {}
    began = time.perf_counter()
    for config in args.configs:
        for strategy, sets in measure(config, args.runs, args.max_tokens).items():
            results[(config, strategy)] = sets
        print(table(results, [config]), file=sys.stderr, flush=True)
    if args.configs:
        report_meshes(results, args, time.perf_counter() - began)
    if args.sweep_layers:
        print("\nlayer-skip sweep (single node, in process, adaptive window 1..8):")
        print(sweep_layer_skip(args.sweep_layers, args.runs, args.max_tokens))


def report_meshes(
    results: dict[tuple[str, str], dict[str, SetRun]], args: argparse.Namespace, wall_s: float
) -> None:
    """Print the meshes' table; exit 1 if any greedy reply differs from its baseline."""
    mismatches = [
        f"{config}/{strategy}/{name}"
        for (config, strategy), sets in results.items()
        for name, run in sets.items()
        if run.texts != results[(config, "baseline")][name].texts
    ]
    print(table(results, args.configs))
    print(
        f"\nmodel {MODEL}, greedy, {args.max_tokens} tokens max per reply, median of "
        f"{args.runs} runs; two stages: 1 BLAS thread per process; "
        f"total {wall_s:.0f} s"
    )
    if mismatches:
        print(f"GREEDY MISMATCH vs baseline: {', '.join(mismatches)}")
        raise SystemExit(1)
    print("greedy replies identical to the baseline in every cell")


if __name__ == "__main__":
    main()
