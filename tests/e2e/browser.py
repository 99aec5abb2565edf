"""Headless Chromium driven over the Chrome DevTools protocol, for the console's tests.

Chromium comes from Debian's package (``apt-get install chromium``); Playwright's own browser
downloads cannot work offline. The protocol runs over ``--remote-debugging-pipe``: the
browser reads commands from its fd 3 and writes replies and events to its fd 4, each
message JSON ending in a NUL byte, so no websocket client is needed. Every wait is bounded.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

#: Where Debian installs the browser; a ``chromium`` on PATH is used when present.
DEBIAN_CHROMIUM = "/usr/bin/chromium"
#: Flags that work in a container as root with no display, GPU or network: no sandbox
#: (root), no GPU, and none of the browser's own background traffic.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-pipe",
)
COMMAND_TIMEOUT_S = 30.0  # one protocol command; a screenshot of a large page takes ~1 s
# A reply bigger than this is a runaway page, not a screenshot of ours (about 1 MB).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def find_chromium() -> str | None:
    """The Chromium executable, or ``None`` when it is not installed."""
    found = shutil.which("chromium")
    if found is not None:
        return found
    return DEBIAN_CHROMIUM if os.access(DEBIAN_CHROMIUM, os.X_OK) else None


class BrowserError(AssertionError):
    """The browser reported an error, died, or did not answer in time."""


class Browser:
    """One headless Chromium with one page; ``close()`` kills it."""

    def __init__(self, executable: str, profile: Path, log_path: Path) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # The browser expects the pipe on fds 3 and 4; the shell moves them there.
        script = f'exec "$@" 3<&{to_browser_r} 4>&{from_browser_w}'
        args = [executable, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"]
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                ["bash", "-c", script, "chromium", *args],
                pass_fds=(to_browser_r, from_browser_w),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self.log_path = log_path
        self._ids = itertools.count(1)
        self._buffer = b""
        self.session = ""

    # -- protocol ------------------------------------------------------------------------

    def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run one command (in the page's session once attached); its result.

        Raises BrowserError for an error reply, a dead browser or a timeout.
        """
        ident = next(self._ids)
        message: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
        if self.session and not method.startswith("Target."):
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while True:
            reply = self._receive(deadline)
            if reply.get("id") != ident:
                continue  # an event, or a reply to nothing we wait for
            if "error" in reply:
                raise BrowserError(f"{method}: {reply['error']}")
            result: dict[str, Any] = reply.get("result", {})
            return result

    def _receive(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select([self._from_browser], [], [], max(0.0, remaining))
            if not ready:
                raise BrowserError(f"no answer from Chromium\n{self.log()}")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise BrowserError(f"Chromium closed the pipe\n{self.log()}")
            self._buffer += chunk
            if len(self._buffer) > MAX_MESSAGE_BYTES:
                raise BrowserError("a protocol message exceeds MAX_MESSAGE_BYTES")
        raw, self._buffer = self._buffer.split(b"\0", 1)
        body: dict[str, Any] = json.loads(raw)
        return body

    # -- the page ------------------------------------------------------------------------

    def open_page(self, width: int, height: int) -> None:
        """Create the page this browser drives, with a fixed viewport."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        attached = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})
        self.session = attached["sessionId"]
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )

    def navigate(self, url: str) -> None:
        self.send("Page.navigate", {"url": url})

    def evaluate(self, expression: str) -> Any:
        """The JSON value of ``expression`` in the page (promises are awaited).

        Raises BrowserError when it throws.
        """
        reply = self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in reply:
            raise BrowserError(f"{expression!r} threw: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float, what: str) -> Any:
        """Poll ``expression`` until it is truthy; its value. Raises BrowserError."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                text = self.evaluate("document.body ? document.body.innerText : ''")
                raise BrowserError(f"timed out waiting for {what}; the page shows:\n{text}")
            time.sleep(0.2)

    def screenshot(self, path: Path) -> Path:
        """Save the page as a PNG at ``path``; returns ``path``."""
        data = self.send("Page.captureScreenshot", {"format": "png"})["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    # -- lifetime ------------------------------------------------------------------------

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        os.close(self._to_browser)
        os.close(self._from_browser)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)

    def __enter__(self) -> Browser:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
