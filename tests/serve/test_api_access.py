"""Who may use the HTTP API (issue 15, item 7): the key, the Host check, the bind refusal.

The server is the node's real app (every route the host serves, the console included)
behind hypercorn on loopback; the clients are the official ``openai`` client and httpx.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio
from typer.testing import CliRunner, Result

from meshnode.cli import app as cli_app
from meshnode.cli import commands as _commands  # noqa: F401  (registers the commands)
from meshnode.errors import ConfigError
from meshnode.net.address import Address
from meshnode.net.http_guard import ApiAccess, HostRule, check_api_exposure, is_loopback
from meshnode.node.config import load_config
from meshnode.serve.service import ServeService
from tests.serve.conftest import TINY_MODEL_ID, Server, start_server

KEY = "sk-mesh-0123456789abcdef"
#: Every data route of a host's app, with a body where it takes one: each needs the key.
GUARDED = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/mesh/status", None),
    ("GET", "/metrics", None),
    ("POST", "/v1/chat/completions", {"model": TINY_MODEL_ID, "messages": []}),
    ("POST", "/v1/completions", {"model": TINY_MODEL_ID, "prompt": "x"}),
    ("GET", f"/v1/models/{TINY_MODEL_ID}", None),
    ("POST", "/v1/messages", {"model": TINY_MODEL_ID, "max_tokens": 1, "messages": []}),
    ("POST", "/v1/messages/count_tokens", {"model": TINY_MODEL_ID, "messages": []}),
    ("POST", "/tokenize", {"model": TINY_MODEL_ID, "prompt": "x"}),
    ("POST", "/detokenize", {"model": TINY_MODEL_ID, "tokens": [1]}),
    ("GET", "/v1/no-such-route", None),  # 401, not 404: a stranger learns no route names
]
#: The console page and its assets (no data; the page asks for the key) and the probe.
PUBLIC = ["/", "/console/api.js", "/health"]


@pytest.fixture
async def keyed(nursery: trio.Nursery, serve_service: ServeService) -> Server:
    """The host's app on loopback with an API key."""
    return await start_server(nursery, serve_service, access=ApiAccess(KEY, HostRule.LOOPBACK))


async def test_the_openai_client_needs_the_right_key(keyed: Server) -> None:
    for wrong in ("sk-wrong", KEY[:-1], KEY + "0"):
        client = openai.AsyncOpenAI(base_url=f"{keyed.base_url}/v1", api_key=wrong, max_retries=0)
        async with client:
            with pytest.raises(openai.AuthenticationError) as info:
                await client.models.list()
        assert info.value.status_code == 401
        assert info.value.code == "invalid_api_key"
    client = openai.AsyncOpenAI(base_url=f"{keyed.base_url}/v1", api_key=KEY, max_retries=0)
    async with client:
        models = await client.models.list()
        reply = await client.chat.completions.create(
            model=TINY_MODEL_ID,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            temperature=0,
        )
    assert [m.id for m in models.data] == [TINY_MODEL_ID]
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 3


async def test_the_anthropic_client_needs_the_right_key(keyed: Server) -> None:
    """Anthropic's clients send the key as ``x-api-key``."""
    hi: Any = [{"role": "user", "content": "Hi"}]
    wrong = anthropic.AsyncAnthropic(base_url=keyed.base_url, api_key="nope", max_retries=0)
    async with wrong:
        with pytest.raises(anthropic.AuthenticationError):
            await wrong.messages.create(model=TINY_MODEL_ID, max_tokens=2, messages=hi)
    right = anthropic.AsyncAnthropic(base_url=keyed.base_url, api_key=KEY, max_retries=0)
    async with right:
        reply = await right.messages.create(model=TINY_MODEL_ID, max_tokens=2, messages=hi)
    assert reply.usage.output_tokens == 2


async def test_every_data_route_needs_the_key_and_the_page_does_not(keyed: Server) -> None:
    async with httpx.AsyncClient(base_url=keyed.base_url) as client:
        for method, path, body in GUARDED:
            missing = await client.request(method, path, json=body)
            assert missing.status_code == 401, path
            assert missing.headers["www-authenticate"] == "Bearer"
            error = missing.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["code"] == "invalid_api_key"
            assert "Missing API key" in error["message"]
            wrong = await client.request(
                method, path, json=body, headers={"Authorization": "Bearer nope"}
            )
            assert wrong.status_code == 401, path
            assert wrong.json()["error"]["message"] == "Incorrect API key provided."
            basic = await client.request(
                method, path, json=body, headers={"Authorization": f"Basic {KEY}"}
            )
            assert basic.status_code == 401, path
        for path in PUBLIC:
            assert (await client.get(path)).status_code == 200, path
        auth = {"Authorization": f"Bearer {KEY}"}
        status = await client.get("/v1/mesh/status", headers=auth)
        assert status.json() == {"node": {"node_id": "test"}}
        metrics = await client.get("/metrics", headers=auth)
        assert "meshnode_requests_waiting" in metrics.text
        assert (await client.get("/v1/no-such-route", headers=auth)).status_code == 404


@pytest.mark.parametrize(
    ("host", "answered"),
    [
        ("127.0.0.1", True),
        ("127.0.0.1:8470", True),
        ("localhost:8470", True),
        ("LOCALHOST", True),
        ("[::1]:8470", True),
        ("evil.example", False),
        ("evil.example:8470", False),
        ("localhost.evil.example", False),
        ("192.168.1.20:8470", False),
        ("127.0.0.1.nip.io", False),
    ],
)
async def test_a_loopback_bind_answers_loopback_hosts_only(
    server: Server, host: str, answered: bool
) -> None:
    async with httpx.AsyncClient(base_url=server.base_url) as client:
        response = await client.get("/v1/mesh/status", headers={"Host": host})
    if answered:
        assert response.status_code == 200
    else:
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "invalid_host"
        assert "DNS rebinding" in error["message"]


async def test_the_host_check_comes_before_the_key(keyed: Server) -> None:
    auth = {"Authorization": f"Bearer {KEY}", "Host": "evil.example"}
    async with httpx.AsyncClient(base_url=keyed.base_url) as client:
        response = await client.get("/v1/models", headers=auth)
    assert response.status_code == 400


@pytest.mark.parametrize(
    ("bind", "key", "host", "answered"),
    [
        # Open bind without a key (--allow-open-api): IP literals, never names.
        ("0.0.0.0", None, "192.168.1.20:8470", True),
        ("0.0.0.0", None, "[fe80::1]:8470", True),
        ("0.0.0.0", None, "localhost", True),
        ("0.0.0.0", None, "evil.example", False),
        ("10.0.0.5", None, "mesh-host.lan", False),
        # With a key the key is the defence: any name.
        ("0.0.0.0", KEY, "mesh-host.lan:8470", True),
        ("::", KEY, "evil.example", True),
        # A loopback bind stays strict even with a key.
        ("127.0.0.1", KEY, "evil.example", False),
        ("::1", KEY, "[::1]:1", True),
        ("localhost", None, "127.0.0.1", True),
    ],
)
def test_host_rules_follow_the_bind(bind: str, key: str | None, host: str, answered: bool) -> None:
    access = ApiAccess.for_bind(Address(bind, 8470), key)
    assert access.host_allowed(host) is answered
    assert access.host_allowed(None)  # no Host: not a browser, so not a rebinding page


def test_keys_are_compared_whole() -> None:
    access = ApiAccess(KEY)
    assert access.key_ok(f"Bearer {KEY}")
    assert access.key_ok(f"bearer {KEY}")
    for header in (None, "", KEY, f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", f"Token {KEY}"):
        assert not access.key_ok(header), header
    assert access.key_ok(None, KEY)  # x-api-key, as Anthropic's clients send it
    assert not access.key_ok(None, KEY[1:])
    assert ApiAccess(None).key_ok(None)
    assert "sk-mesh" not in repr(access)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("192.168.1.2", False), ("example.com", False)],
)  # fmt: skip
def test_loopback_binds(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_an_open_bind_needs_a_key_or_an_explicit_allowance() -> None:
    with pytest.raises(ConfigError, match=r"--api 0\.0\.0\.0:8470 is reachable.*--api-key"):
        check_api_exposure(Address("0.0.0.0", 8470), None, allow_open=False)
    check_api_exposure(Address("0.0.0.0", 8470), KEY, allow_open=False)
    check_api_exposure(Address("0.0.0.0", 8470), None, allow_open=True)
    check_api_exposure(Address("127.0.0.1", 8470), None, allow_open=False)


def test_join_refuses_an_open_api_without_a_key(tmp_path: Path) -> None:
    args = ["join", "--token", "x", "--state-dir", str(tmp_path), "--api", "0.0.0.0:0"]
    result = CliRunner().invoke(cli_app, args, env={"MESHNODE_API_KEY": None})
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("meshnode join: --api 0.0.0.0:0 is reachable from other machines")


def test_the_key_comes_from_flag_env_or_file(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('[node]\napi_key = "from-file"\nallow_open_api = true\napi_max_body = "1MiB"\n')
    from_file = load_config(config_file=path, env={})
    assert (from_file.api_key, from_file.allow_open_api) == ("from-file", True)
    assert from_file.api_max_body_bytes == 1 << 20
    from_env = load_config(config_file=path, env={"MESHNODE_API_KEY": "from-env"})
    assert from_env.api_key == "from-env"
    flags = {"api_key": "from-flag", "api_max_body_bytes": "2MiB"}
    from_flag = load_config(config_file=path, env={"MESHNODE_API_KEY": "e"}, flags=flags)
    assert (from_flag.api_key, from_flag.api_max_body_bytes) == ("from-flag", 2 << 20)
    assert "from-flag" not in repr(from_flag)
    for bad in ("two words", "", "tab\tkey", "ключ"):
        with pytest.raises(ConfigError, match="--api-key"):
            load_config(env={}, flags={"api_key": bad})
    with pytest.raises(ConfigError, match="MESHNODE_API_MAX_BODY"):
        load_config(env={"MESHNODE_API_MAX_BODY": "0"})


async def test_status_sends_the_key(keyed: Server, tmp_path: Path) -> None:
    def status(*extra: str) -> Result:
        args = ["status", "--api", str(keyed.address), "--state-dir", str(tmp_path), "--json"]
        return CliRunner().invoke(cli_app, [*args, *extra], env={"MESHNODE_API_KEY": None})

    refused = await trio.to_thread.run_sync(status)
    assert refused.exit_code == 1
    assert "wants the API key" in refused.output
    answered = await trio.to_thread.run_sync(status, "--api-key", KEY)
    assert answered.exit_code == 0, answered.output
    assert json.loads(answered.stdout) == {"node": {"node_id": "test"}}
