"""The daemon process: its entry point, signals, token, and the node file.

``run(config, build)`` provisions the token and identity, builds the node (the caller's
``build`` adds the API and, with ``--model``, the host role) and runs it until SIGINT or
SIGTERM, which stop the node (:meth:`~meshnode.node.daemon.Node.stop`: the roles stop and
``Goodbye`` goes out on every session) before everything is cancelled (and the mDNS record
unregistered). While it runs, ``<state-dir>/node.json`` says where: that is how
``meshnode status`` and the tests find a running daemon.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from meshnode.engine.backend import limit_cpu_threads
from meshnode.net.identity import JoinToken, NodeIdentity, TokenError, write_token_file
from meshnode.net.logtext import OneLineFormatter
from meshnode.net.secret_files import private_dir, write_private
from meshnode.node import heap
from meshnode.node.config import Address, ConfigError, NodeConfig
from meshnode.node.daemon import Node

log = logging.getLogger("meshnode.node")

NODE_FILE = "node.json"


@dataclass(frozen=True, slots=True)
class RunningNode:
    """Contents of ``<state-dir>/node.json`` while a daemon runs."""

    node_id: str
    pid: int
    listen: Address
    api: Address


def write_node_file(state_dir: Path, node: RunningNode) -> None:
    """Atomically write ``node.json`` (actual ports, so port 0 works in tests), never
    through a link."""
    body = {"node_id": node.node_id, "pid": node.pid, "listen": str(node.listen)}
    body["api"] = str(node.api)
    write_private(state_dir / NODE_FILE, (json.dumps(body) + "\n").encode(), overwrite=True)


def read_node_file(state_dir: Path) -> RunningNode | None:
    """The running daemon's addresses, or ``None`` when none wrote its file."""
    try:
        body = json.loads((state_dir / NODE_FILE).read_text())
        return RunningNode(
            node_id=str(body["node_id"]),
            pid=int(body["pid"]),
            listen=Address.parse(body["listen"]),
            api=Address.parse(body["api"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


NodeBuilder = Callable[[NodeConfig, JoinToken, NodeIdentity], Awaitable[Node]]
"""Builds the node to run (``meshnode.cli.join`` adds its API and, with ``--model``, the host)."""


async def serve_until_signalled(
    build: NodeBuilder, config: NodeConfig, token: JoinToken, identity: NodeIdentity
) -> None:
    """Build the node, run it until SIGINT or SIGTERM, then say goodbye and stop."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        node = await build(config, token, identity)
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            # Both are set before the node reports started.
            assert node.listen is not None
            assert node.api is not None
            write_node_file(
                config.state_dir, RunningNode(node.node_id, os.getpid(), node.listen, node.api)
            )
            async for signum in signals:
                log.info(
                    "%s: stopping; saying goodbye to %d peer(s)",
                    signal.Signals(signum).name,
                    len(node.sessions),
                )
                break
            await node.stop()
            nursery.cancel_scope.cancel()


def _first(group: BaseExceptionGroup[BaseException], kind: type[ConfigError]) -> ConfigError | None:
    """The first ``kind`` exception anywhere in ``group``, or None."""
    for exc in group.exceptions:
        if isinstance(exc, kind):
            return exc
        if isinstance(exc, BaseExceptionGroup) and (found := _first(exc, kind)) is not None:
            return found
    return None


def _token(config: NodeConfig) -> JoinToken:
    """The mesh token; a node given none creates a new mesh and keeps its token 0600."""
    text = config.resolve_token()
    if text is None:
        token = JoinToken.generate(socket.gethostname())
        write_token_file(config.own_token_file, token)
        log.warning(
            "no join token given: created mesh %r; other machines join it with "
            "`meshnode join --token-file FILE` where FILE holds the contents of %s",
            token.name,
            config.own_token_file,
        )
        return token
    try:
        return JoinToken.parse(text)
    except TokenError as exc:
        raise ConfigError(str(exc)) from exc


def configure_logging(config: NodeConfig) -> None:
    """The daemon's log format and level (before anything worth logging happens)."""
    handler = logging.StreamHandler()
    # One line per record, whatever text a peer put in it (issue 36, item 9).
    handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=config.log_level, handlers=[handler])


def run(config: NodeConfig, build: NodeBuilder) -> int:
    """``meshnode join``: provision identity, run the node until interrupted; exit status.

    Raises ConfigError (one line, for the CLI's exit 2) when the node cannot start as
    configured, e.g. ``--api`` or ``--listen`` on an address in use.
    """
    configure_logging(config)
    heap.limit_malloc_arenas()  # before trio, the stage and the kernels start threads
    private_dir(config.state_dir)  # refused when others could plant links in it
    token = _token(config)
    limit = limit_cpu_threads(config.threads)  # held while the node runs
    identity = NodeIdentity.provision(token, config.state_dir)
    try:
        trio.run(serve_until_signalled, build, config, token, identity)
    except BaseExceptionGroup as group:
        # A start-up ConfigError raised inside the node's nurseries arrives wrapped.
        found = _first(group, ConfigError)
        if found is None:
            raise
        raise found from None
    finally:
        running = read_node_file(config.state_dir)
        if running is not None and running.pid == os.getpid():
            (config.state_dir / NODE_FILE).unlink(missing_ok=True)
    del limit
    log.info("node %s stopped", identity.node_id)
    return 0
