"""``meshnode init``, ``meshnode join`` and ``meshnode status``: create, run and inspect a mesh."""

from __future__ import annotations

import json
import math
import socket
import sys
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from meshnode.cli import app
from meshnode.cli.options import with_setting_options
from meshnode.net.identity import JoinToken, write_token_file
from meshnode.node.config import (
    Address,
    ConfigError,
    SpeculativeFlags,
    config_file_for,
    load_config,
)
from meshnode.node.settings import env_help

# `status` gives up on a silent daemon quickly: it is a local, interactive command.
STATUS_TIMEOUT_S = 3.0


@app.command()
def init(
    name: Annotated[str | None, typer.Option(help="Mesh name (default: this host's name).")] = None,
    token_file: Annotated[
        Path | None, typer.Option(help="Also write the token to this file, mode 0600.")
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Overwrite an existing --token-file (its mesh becomes unjoinable)."
        ),
    ] = False,
) -> None:
    """Create a new mesh and print its join token (the last line of the output)."""
    token = JoinToken.generate(name or socket.gethostname().split(".")[0])
    if token_file is not None:
        try:
            write_token_file(token_file, token, overwrite=force)
        except (ConfigError, OSError) as exc:
            hint = "; pass --force to replace it" if token_file.exists() and not force else ""
            typer.echo(f"meshnode init: {exc}{hint}", err=True)
            raise typer.Exit(2) from exc
        typer.echo(f"wrote the join token to {token_file} (mode 0600)")
    typer.echo(f"created mesh {token.name!r} (mesh id {token.mesh_id})")
    typer.echo("join it on each machine: meshnode join --token-file FILE  (or --token TOKEN)")
    typer.echo(str(token))


def _address(text: str | None) -> Address | None:
    return None if text is None else Address.parse(text)


@app.command()
@with_setting_options
def join(
    settings: dict[str, Any],
    config: Annotated[Path | None, typer.Option(help="TOML config file.")] = None,
    speculative: Annotated[
        str | None,
        typer.Option(
            help="Speculative decoding: off, auto (default), ngram, draft, layer-skip or mtp. "
            "Overrides the config tables models.<id>.speculative and "
            "defaults.speculative, and the package."
        ),
    ] = None,
    draft_model: Annotated[
        str | None, typer.Option(help="Draft model for --speculative draft (any model ref).")
    ] = None,
    no_draft: Annotated[
        bool,
        typer.Option("--no-draft", help="Never load a draft model, even one the package names."),
    ] = False,
    window_policy: Annotated[
        str | None, typer.Option(help="Speculation window: fixed or adaptive.")
    ] = None,
    initial_window: Annotated[
        int | None, typer.Option(help="Drafts per verify pass to start with.")
    ] = None,
    min_window: Annotated[int | None, typer.Option(help="Smallest adaptive window.")] = None,
    max_window: Annotated[int | None, typer.Option(help="Largest adaptive window.")] = None,
    layer_skip_layers: Annotated[
        int | None, typer.Option(help="Layers a layer-skip draft runs (default: 9/10 of them).")
    ] = None,
) -> None:
    """Run this node in the mesh until interrupted (SIGINT or SIGTERM say goodbye)."""
    from meshnode.cli import join

    spec_flags = SpeculativeFlags(
        strategy=speculative,
        draft_model=draft_model,
        no_draft=no_draft,
        window_policy=window_policy,
        initial_window=initial_window,
        min_window=min_window,
        max_window=max_window,
        layer_skip_layers=layer_skip_layers,
    )
    try:
        flags: dict[str, Any] = {**settings, "speculative": spec_flags}
        config_file = config_file_for(config, settings["state_dir"])
        node_config = load_config(config_file=config_file, flags=flags)
        code = join.run(node_config)
    except ConfigError as exc:
        typer.echo(f"meshnode join: {exc}", err=True)
        raise typer.Exit(2) from exc
    raise typer.Exit(code)


@app.command()
def status(
    api: Annotated[str | None, typer.Option(help="The daemon's API address HOST:PORT.")] = None,
    state_dir: Annotated[
        Path | None, typer.Option(help="Find the daemon through its state dir.")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(help=env_help("api_key", "The daemon's API key (default: its config's).")),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Show this node, its mesh and its peers; exit 1 when no daemon answers."""
    from meshnode.node.process import read_node_file

    try:
        # The daemon's config file too: its API key may be there.
        config = load_config(
            config_file=config_file_for(None, state_dir),
            flags={"state_dir": state_dir, "api_key": api_key},
        )
        address = _address(api)
        if address is None:
            running = read_node_file(config.state_dir)
            address = running.api if running is not None else config.api
    except ConfigError as exc:
        typer.echo(f"meshnode status: {exc}", err=True)
        raise typer.Exit(2) from exc
    url = f"http://{address}/v1/mesh/status"
    headers = {} if config.api_key is None else {"Authorization": f"Bearer {config.api_key}"}
    try:
        response = httpx.get(url, headers=headers, timeout=STATUS_TIMEOUT_S)
        if response.status_code == 401:
            typer.echo(f"meshnode status: {url} wants the API key (--api-key)", err=True)
            raise typer.Exit(1)
        response.raise_for_status()
        body: dict[str, Any] = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        typer.echo(f"meshnode status: no meshnode daemon answers at {url} ({exc})", err=True)
        raise typer.Exit(1) from exc
    if as_json:
        json.dump(body, sys.stdout)
        sys.stdout.write("\n")
    else:
        typer.echo(format_status(body))


def _memory(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def _moe_line(moe: dict[str, Any]) -> str:
    """A mixture of experts' shape: ``experts  128 per layer, 8 per token ...``."""
    return (
        f"experts  {moe['experts_per_layer']} per layer, {moe['experts_per_token']} per "
        f"token, on {moe['moe_layers']} of {moe['layers']} layers; "
        f"{_params(moe['params'])} parameters, {_params(moe['active_params'])} active"
    )


def _params(n: int) -> str:
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _host_lines(host: dict[str, Any] | None) -> list[str]:
    """The served model and its speculative decoding (host nodes only)."""
    if not host:
        return []
    lines = [
        f"serving  {host.get('model_id', host.get('model'))}  ({host.get('state')}, "
        f"{host.get('requests_in_flight', 0)} requests in flight)"
    ]
    if host.get("moe"):
        lines.append(_moe_line(host["moe"]))
    if host.get("error"):
        lines.append(f"waiting  {host['error']}")
    if host.get("last_failure") and host.get("last_failure") != host.get("error"):
        # The failure that made the last replan, not a present one: "failed" beside a
        # ready run read as if serving had stopped.
        lines.append(f"last failure  {host['last_failure']}")
    lines += _placement_line(host)
    cooling = _cooling_off(host.get("cooling_off"))
    if cooling:
        lines.append(f"cooling off  {cooling}  (blamed for a stage failure; no plan uses them)")
    spec = host.get("speculation")
    if spec:
        acceptance = spec.get("acceptance", {})
        rate = acceptance.get("accept_rate")
        shown = "-" if rate is None else f"{rate:.0%}"
        lines.append(
            f"speculate {spec['strategy']}  (accepted {acceptance.get('accepted', 0)}/"
            f"{acceptance.get('proposed', 0)} drafts, {shown})"
        )
        lines += [f"warning  {w}" for w in spec.get("warnings", [])]
    return lines


def _placement_line(host: dict[str, Any]) -> list[str]:
    """What the layer split follows, and how the stages' speeds were measured (issue 34)."""
    placed = host.get("placed_by")
    if not placed:  # a daemon from before the field
        return []
    by = "measured speed" if placed == "speed" else "memory"
    lines = [f"placed   by {by}  (calibration: {host.get('calibration') or '-'})"]
    for stage in host.get("stages") or []:
        if (claim := stage.get("self_measured")) is not None:
            lines.append(f"measured {stage['node_id']}  {_self_measured(claim)}")
        if stage.get("offload_bytes"):
            lines.append(
                f"warning  {stage['node_id']} reads {_mib(stage['offload_bytes'])} of its "
                "layers from disk (the mesh's memory is short): its disk bounds decode"
            )
    return lines


def _self_measured(claim: dict[str, Any]) -> str:
    """What a node measured of itself as it prepared (node/claims.py), or why not."""
    if "error" in claim:
        return f"- ({claim['error']}: planned by memory)"
    disk = f", disk {claim['disk_mb_s']} MB/s" if claim.get("disk_mb_s") else ""
    return (
        f"{claim['decode_us']} us/layer a token at decode (8 rows {claim['batch8_us']}, "
        f"prefill {claim['prefill_us']}){disk}"
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def _cooling_off(nodes: dict[str, float] | None) -> str:
    """Blamed nodes and the time each still sits out, soonest back first: ``bbbb 4m 12s``."""
    left = sorted((s, n) for n, s in (nodes or {}).items() if s > 0)
    return ", ".join(f"{node} {_duration(seconds)}" for seconds, node in left)


def _duration(seconds: float) -> str:
    whole = math.ceil(seconds)
    return f"{whole // 60}m {whole % 60:02d}s" if whole >= 60 else f"{whole}s"


def _progress(done: int, total: int) -> str:
    if total <= 1:  # a local source: nothing to transfer
        return "local" if total else "-"
    return f"{done / 2**20:.1f}/{total / 2**20:.1f} MiB"


def _rate(bytes_per_s: float | None) -> str:
    """A stage's measured decode rate: weight bytes it reads a second, one row a pass."""
    return "-" if not bytes_per_s else f"{bytes_per_s / 1e6:.0f} MB/s"


def _layers(layers: list[int]) -> str:
    """Layers ``[start, end)`` as the inclusive ``start-last``, so that neighbouring stages
    do not read as overlapping (``0-11``, ``12-29``, not ``0-12``, ``12-30``)."""
    start, end = layers
    return "none" if end <= start else f"{start}-{end - 1}"


def _stage_rows(host: dict[str, Any] | None) -> list[tuple[str, ...]]:
    """The plan: one row per stage, in pipeline order."""
    stages = (host or {}).get("stages") or []
    header = ("STAGE", "NODE ID", "LAYERS", "STATE", "PREPARED", "DECODE", "HOP IN")
    rows: list[tuple[str, ...]] = [header]
    for index, stage in enumerate(stages):
        extras = [name for name in ("embed", "head") if stage.get(name)]
        layers = _layers(stage["layers"]) + (f" +{'+'.join(extras)}" if extras else "")
        prepared = _progress(stage.get("bytes_done", 0), stage.get("bytes_total", 0))
        rate = _rate(stage.get("decode_bytes_per_s"))
        row = (str(index), stage["node_id"], layers, stage["state"], prepared, rate, _hop(stage))
        rows.append(row)
    return rows if len(rows) > 1 else []


def _hop(stage: dict[str, Any]) -> str:
    """The hop into a stage from the one before: its time a token, the link's measured
    rate (the host's own into stage 1, between two workers the one they reported)."""
    if stage.get("hop_ms") is None:
        return "-"
    link = stage.get("link_mbytes_per_s")
    rate = "link not measured" if link is None else f"{link:.{1 if link >= 1 else 3}f} MB/s"
    return f"{stage['hop_ms']:.2f} ms from {stage.get('hop_from', '?')} ({rate})"


def _run_line(run: dict[str, Any] | None) -> list[str]:
    """This node's own stage when another node's run claimed it."""
    if not run or "layers" not in run:
        return []
    layers = _layers(run["layers"])
    return [f"stage    layers {layers} for {run['coordinator']}  ({run['state']})"]


def _pool_lines(body: dict[str, Any]) -> list[str]:
    """The prefix pool of each stage this node runs (issue 30): its blocks in use by live
    sequences, cached for later prompts and free (a hybrid stage: its snapshots), and the
    prompt tokens reused so far."""
    lines = []
    for role, part in (("stage 0", body.get("host")), ("stage", body.get("run"))):
        kv = (part or {}).get("kv") or {}
        if "prefix_snapshots" in kv:  # a hybrid stage: recurrent snapshots, no blocks
            lines.append(
                f"prefix   {role}: {kv['prefix_snapshots']} snapshots of at most "
                f"{kv['prefix_snapshots_max']} ({kv['prefix_snapshot_bytes']} bytes); "
                f"{kv['prefix_hit_tokens']} prompt tokens reused, "
                f"{kv['prefix_miss_tokens']} computed"
            )
        if "prefix_blocks_total" not in kv:
            continue
        lines.append(
            f"prefix   {role}: {kv['prefix_blocks_used']} used, {kv['prefix_blocks_cached']} "
            f"cached, {kv['prefix_blocks_free']} free of {kv['prefix_blocks_total']} blocks "
            f"({kv['prefix_block_tokens']} tokens each); {kv.get('prefix_hit_tokens', 0)} "
            f"prompt tokens reused, {kv.get('prefix_miss_tokens', 0)} computed"
        )
    return lines


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def format_status(body: dict[str, Any]) -> str:
    """The human-readable form of a ``/v1/mesh/status`` body."""
    node = body["node"]
    lines = [
        f"node     {node['node_id']}  ({node['device']}, {_memory(node['usable_memory'])} usable)",
        f"mesh     {node['mesh_name']}  (id {node['mesh_id']})",
        f"listen   {node['listen']}   api {node['api']}",
        *_host_lines(body.get("host")),
        *_run_line(body.get("run")),
        *_pool_lines(body),
        "",
    ]
    stages = _stage_rows(body.get("host"))
    if stages:
        lines += [*_table(stages), ""]
    header = ("NODE ID", "ADDRESS", "DEVICE", "MEMORY", "STATE", "RTT", "LINK", "LAST SEEN")
    rows: list[tuple[str, ...]] = [header]
    for p in body["peers"]:
        rtt = "-" if p.get("rtt_ms") is None else f"{p['rtt_ms']:.1f} ms"
        link = "-" if p.get("link_mbytes_per_s") is None else f"{p['link_mbytes_per_s']:.1f} MB/s"
        rows.append(
            (
                p["node_id"],
                p["address"],
                p["device"],
                _memory(p["usable_memory"]),
                p["state"],
                rtt,
                link,
                f"{p['last_seen_s_ago']:.1f} s ago",
            )
        )
    if len(rows) == 1:
        return "\n".join([*lines, "no peers yet"])
    return "\n".join([*lines, *_table(rows)]).rstrip()
