"""The planner's records: what it is told of a model and of the live nodes, and the plan
it returns (:mod:`meshnode.node.planner` places; :mod:`meshnode.node.plan_cost` prices).

Plain frozen values, validated in their constructors: a node's speed and link rates are
measurements (its own or the host's), so a NaN or an infinite figure is refused here
rather than turned into a free stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelFootprint:
    """What the planner needs to know of a model, in bytes as loaded on the devices."""

    layer_bytes: tuple[int, ...]
    embed_bytes: int
    head_bytes: int
    kv_bytes_per_token_per_layer: int
    tied_head: bool = False
    # Hybrid models: whether each layer holds a KV cache (empty: every layer does), and the
    # bytes each layer holds whatever the context (recurrent state and snapshot ring of
    # every live sequence; empty: none).
    kv_layers: tuple[bool, ...] = ()
    fixed_layer_bytes: tuple[int, ...] = ()
    # What a hop carries a token: one row of activations at the wire dtype (0: not counted).
    activation_bytes_per_token: int = 0
    # A CPU or CUDA stage's pool of KV blocks (issue 30): positions it holds for a context
    # (None: every live sequence preallocates its context there too), at one sequence's
    # bytes.
    pool_tokens: Callable[[int], int] | None = None
    pool_kv_bytes_per_token_per_layer: int = 0

    @property
    def n_layers(self) -> int:
        return len(self.layer_bytes)

    def kv_bytes(self, start: int, end: int, context_tokens: int, device: str) -> int:
        """KV bytes of layers ``[start, end)`` for ``context_tokens`` on a ``device`` node:
        a CPU or CUDA node's pool, else (no pool: a hybrid model; a device not known
        here) every live sequence's context."""
        kv_layers = sum(self.kv_layers[start:end]) if self.kv_layers else end - start
        if device in ("cpu", "cuda") and self.pool_tokens is not None:
            per_layer = self.pool_kv_bytes_per_token_per_layer * self.pool_tokens(context_tokens)
            return kv_layers * per_layer
        return kv_layers * self.kv_bytes_per_token_per_layer * context_tokens


@dataclass(frozen=True, slots=True)
class NodeCapacity:
    """One live node as the planner sees it."""

    node_id: str
    usable_memory_bytes: int
    device: str = "cpu"
    rtt_s: float = 0.0
    speed: NodeSpeed | None = None
    # the measured rate of the host's link to the node (meshnode.node.links); 0: unknown
    link_bytes_per_s: float = 0.0
    # the node's own measured links to its peers, as it reported them (claims, bounded by
    # meshnode.node.claims): the hop between its stage and a neighbour's (plan_cost.hop_link)
    links: tuple[NodeLink, ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 <= self.link_bytes_per_s < float("inf"):
            raise ValueError(
                f"link_bytes_per_s must be >= 0 and finite, not {self.link_bytes_per_s}"
            )


@dataclass(frozen=True, slots=True)
class NodeLink:
    """A node's measured link to its peer ``node_id``: the round trip (0: not known) and
    the rate in bytes a second (0: not measured)."""

    node_id: str
    rtt_s: float = 0.0
    bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("rtt_s", "bytes_per_s"):
            if not 0.0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be >= 0 and finite, not {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class NodeSpeed:
    """What a node measured of itself for one model (its calibration), as rates.

    ``decode_bytes_per_s``: layer weight bytes one decode step of one row gets through per
    second on the node's backend, threads and the model's own formats (a stage of ``B``
    weight bytes takes ``B / decode_bytes_per_s`` seconds a token).
    """

    decode_bytes_per_s: float
    # the read rate of the node's disk (its model file), for weight bytes served past its
    # memory (module docstring, Larger than memory); 0: not measured
    disk_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        rate = self.decode_bytes_per_s
        # NaN fails both comparisons; an infinite rate would make every stage free
        if not 0.0 < rate < float("inf"):
            raise ValueError(f"decode_bytes_per_s must be positive and finite, not {rate}")
        if not 0.0 <= self.disk_bytes_per_s < float("inf"):
            raise ValueError(
                f"disk_bytes_per_s must be >= 0 and finite, not {self.disk_bytes_per_s}"
            )


@dataclass(frozen=True, slots=True)
class StagePlan:
    """Node ``node_id`` runs layers ``[start, end)``; ``embed``/``head`` when first/last."""

    node_id: str
    start: int
    end: int
    embed: bool
    head: bool
    memory_bytes: int
    # bytes past the node's usable memory, served from the memory-mapped file (module
    # docstring, Larger than memory); 0 when the stage fits
    offload_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Plan:
    """Stages in pipeline order; stage 0 is on the host."""

    stages: tuple[StagePlan, ...]
    context_tokens: int
    measured: bool = False  # placed by the nodes' measured speeds, not by memory

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(stage.node_id for stage in self.stages)
