"""The web console's routes (issue 20).

The page itself is tested in a real browser in ``tests/e2e/test_console.py``; here: the
routes serve exactly the packaged files, and the package carries every file the page loads.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from importlib import resources
from pathlib import Path

import httpx
import pytest

from meshnode.serve.console import ASSETS
from tests.conftest import REPO_ROOT
from tests.serve.conftest import Server

STATIC = resources.files("meshnode.serve.console") / "static"


async def _get(server: Server, path: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10.0) as http:
        return await http.get(server.base_url + path)


async def test_the_page_and_each_asset_are_served_as_packaged(server: Server) -> None:
    page = await _get(server, "/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.content == (STATIC / "index.html").read_bytes()
    for name, content_type in ASSETS.items():
        response = await _get(server, f"/console/{name}")
        assert response.status_code == 200, name
        assert response.headers["content-type"] == content_type
        assert response.headers["cache-control"] == "no-cache"
        assert response.content == (STATIC / name).read_bytes()


@pytest.mark.parametrize(
    "path",
    ["/console/nope.js", "/console/__init__.py", "/console/..%2F__init__.py", "/console/"],
)
async def test_only_the_listed_assets_are_served(server: Server, path: str) -> None:
    assert (await _get(server, path)).status_code == 404


def test_every_file_the_page_loads_is_listed_and_nothing_else_ships() -> None:
    html = (STATIC / "index.html").read_text()
    wanted = set(re.findall(r'(?:src|href)="console/([^"]+)"', html))
    for name in ASSETS:
        if name.endswith(".js"):
            wanted |= set(re.findall(r'from "\./([^"]+)"', (STATIC / name).read_text()))
    assert wanted <= set(ASSETS)
    shipped = {entry.name for entry in STATIC.iterdir()}
    assert shipped == set(ASSETS)


def test_the_package_data_carries_the_console() -> None:
    # A wheel built from pyproject.toml holds exactly the package data it names: every
    # console file must match one of its patterns, or an installed node serves no page.
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["meshnode"]
    for name in ASSETS:
        relative = f"serve/console/static/{name}"
        assert any(fnmatch.fnmatch(relative, p) for p in patterns), relative


def test_the_console_needs_no_network(tmp_path: Path) -> None:
    # Offline: nothing the page loads names another origin (no CDN, no web fonts).
    for name in ASSETS:
        text = (STATIC / name).read_text()
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", text), name
        assert "//cdn" not in text, name
