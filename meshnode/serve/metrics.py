"""Prometheus metrics for the serving node, in the text exposition format (version 0.0.4).

A few counters and histograms do not justify a dependency on ``prometheus_client``: the
format is a handful of lines per metric. Every metric is owned by one :class:`ServeMetrics`
object per service; the event loop is the only writer (the compute thread reports its
timings through the pipeline's return values), so no locking is needed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from meshnode.speculative.telemetry import SpecStats

#: Latency buckets in seconds, from a fast local decode step (~ms) to a slow cold prefill.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
#: Whole-request buckets in seconds: a short reply on a GPU (~0.1 s) to a long CPU reply
#: across a mesh (minutes; the README's example once ran 48 s before it had a token cap).
REQUEST_BUCKETS_S: tuple[float, ...] = (
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)

Labels = tuple[tuple[str, str], ...]


def _format_labels(labels: Labels, extra: Labels = ()) -> str:
    pairs = labels + extra
    if not pairs:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


@dataclass
class Counter:
    """A monotonically increasing value per label set."""

    name: str
    help: str
    values: dict[Labels, float] = field(default_factory=dict)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        """Add ``amount`` (>= 0) to the series with these labels."""
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        """The current value of one series (0 if never incremented)."""
        return self.values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} counter"
        if not self.values:
            yield f"{self.name} 0"
        for labels, value in sorted(self.values.items()):
            yield f"{self.name}{_format_labels(labels)} {_format_value(value)}"


@dataclass
class Gauge:
    """A value that goes up and down (no labels); with ``read``, read when rendered."""

    name: str
    help: str
    value: float = 0.0
    read: Callable[[], float] | None = None

    def render(self) -> Iterable[str]:
        if self.read is not None:
            self.value = self.read()
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} gauge"
        yield f"{self.name} {_format_value(self.value)}"


@dataclass
class _Buckets:
    """One series of a histogram: cumulative bucket counts, sum and count."""

    counts: list[int]
    total: float = 0.0
    count: int = 0


@dataclass
class Histogram:
    """Cumulative buckets, sum and count of observed values, per label set."""

    name: str
    help: str
    buckets: Sequence[float] = LATENCY_BUCKETS_S
    series: dict[Labels, _Buckets] = field(default_factory=dict)

    def observe(self, value: float, **labels: str) -> None:
        """Record one observation in the series with these labels."""
        key = tuple(sorted(labels.items()))
        if key not in self.series:
            self.series[key] = _Buckets([0] * len(self.buckets))
        series = self.series[key]
        series.total += value
        series.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                series.counts[i] += 1

    @property
    def count(self) -> int:
        """Observations in all series."""
        return sum(s.count for s in self.series.values())

    @property
    def total(self) -> float:
        """Sum of the observations in all series."""
        return sum(s.total for s in self.series.values())

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        # An unlabelled histogram shows its empty series, as prometheus_client does.
        series = self.series or {(): _Buckets([0] * len(self.buckets))}
        for labels, s in sorted(series.items()):
            for bound, n in zip(self.buckets, s.counts, strict=True):
                le = (("le", _format_value(bound)),)
                yield f"{self.name}_bucket{_format_labels(labels, le)} {n}"
            yield f"{self.name}_bucket{_format_labels(labels, (('le', '+Inf'),))} {s.count}"
            yield f"{self.name}_sum{_format_labels(labels)} {_format_value(s.total)}"
            yield f"{self.name}_count{_format_labels(labels)} {s.count}"


Sample = tuple[Labels, float]


def family(name: str, kind: str, help: str, samples: Iterable[Sample]) -> Iterable[str]:
    """The lines of one metric family of ``kind`` (gauge, counter) with these samples."""
    yield f"# HELP {name} {help}"
    yield f"# TYPE {name} {kind}"
    for labels, value in samples:
        yield f"{name}{_format_labels(labels)} {_format_value(value)}"


class ServeMetrics:
    """Every metric the serving node exports under ``/metrics``.

    ``waiting`` reads how many requests wait for a generation slot or KV blocks (the
    scheduler's counts).
    """

    def __init__(self, waiting: Callable[[], int] = lambda: 0) -> None:
        self.requests = Counter(
            "meshnode_requests_total", "Finished API requests by endpoint and outcome."
        )
        self.prompt_tokens = Counter("meshnode_prompt_tokens_total", "Prompt tokens prefilled.")
        self.prompt_cached_tokens = Counter(
            "meshnode_prompt_cached_tokens_total",
            "Prompt tokens resumed from the stages' prefix cache instead of computed.",
        )
        self.generation_tokens = Counter(
            "meshnode_generation_tokens_total", "Completion tokens, counted as they come."
        )
        self.in_flight = Gauge("meshnode_requests_in_flight", "Requests being generated now.")
        self.replays = Counter(
            "meshnode_replays_total",
            "Replays of requests on a new pipeline after a stage of theirs was lost.",
        )
        self.waiting = Gauge(
            "meshnode_requests_waiting",
            "Requests waiting for a generation slot or KV blocks.",
            read=lambda: float(waiting()),
        )
        self.ttft = Histogram(
            "meshnode_time_to_first_token_seconds",
            "From admission to the first token (observed when the first token comes).",
        )
        self.tpot = Histogram(
            "meshnode_time_per_output_token_seconds",
            "Mean time per completion token after the first, per request.",
        )
        self.stage_compute = Histogram(
            "meshnode_stage_compute_seconds", "Compute time of one pipeline pass, all stages."
        )
        self.wire = Histogram(
            "meshnode_wire_seconds", "Time of one pipeline pass not spent computing."
        )
        self.stage_seconds = Counter(
            "meshnode_stage_seconds_total",
            "Compute seconds of each pipeline stage (by index, 0 on this node), all passes.",
        )
        self.spec_proposed = Counter(
            "meshnode_spec_proposed_tokens_total", "Draft tokens sent for verification."
        )
        self.spec_accepted = Counter(
            "meshnode_spec_accepted_tokens_total", "Draft tokens the target accepted."
        )
        self.spec_windows = Counter("meshnode_spec_windows_total", "Verify passes run.")
        self.spec_verify_seconds = Counter(
            "meshnode_spec_verify_seconds_total", "Wall time of verify passes."
        )
        self.spec_plain_steps = Counter(
            "meshnode_spec_plain_steps_total", "Decode passes that carried no drafts."
        )
        self.spec_requests = Counter(
            "meshnode_spec_requests_total", "Finished generations by speculative strategy."
        )
        self.spec_accept_rate = Gauge(
            "meshnode_spec_accept_rate", "Accepted over proposed drafts, all requests so far."
        )
        self.spec_tokens_per_verify = Gauge(
            "meshnode_spec_tokens_per_verify",
            "Tokens committed per verify pass (accepted drafts + 1), all requests so far.",
        )
        self.spec_cost_per_token = Gauge(
            "meshnode_spec_cost_per_accepted_token_seconds",
            "Verify seconds per token committed by verify passes, all requests so far.",
        )

    def observe_speculation(self, strategy: str, run: SpecStats, total: SpecStats) -> None:
        """Add one finished request's counters; ``total`` (all requests) sets the rates."""
        self.spec_requests.inc(strategy=strategy)
        self.spec_windows.inc(run.windows)
        self.spec_proposed.inc(run.proposed)
        self.spec_accepted.inc(run.accepted)
        self.spec_verify_seconds.inc(run.verify_seconds)
        self.spec_plain_steps.inc(run.plain_steps)
        self.spec_accept_rate.value = total.accept_rate or 0.0
        self.spec_tokens_per_verify.value = total.tokens_per_verify or 0.0
        self.spec_cost_per_token.value = total.cost_per_accepted_token or 0.0

    def _all(self) -> list[Counter | Gauge | Histogram]:
        return [
            self.requests,
            self.prompt_tokens,
            self.generation_tokens,
            self.in_flight,
            self.replays,
            self.prompt_cached_tokens,
            self.waiting,
            self.ttft,
            self.tpot,
            self.stage_compute,
            self.wire,
            self.stage_seconds,
            self.spec_proposed,
            self.spec_accepted,
            self.spec_windows,
            self.spec_verify_seconds,
            self.spec_plain_steps,
            self.spec_requests,
            self.spec_accept_rate,
            self.spec_tokens_per_verify,
            self.spec_cost_per_token,
        ]

    def render(self) -> str:
        """The whole exposition text, newline-terminated."""
        lines: list[str] = []
        for metric in self._all():
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"


#: The content type Prometheus scrapers expect for the text format.
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
