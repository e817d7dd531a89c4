"""Serve an aiohttp application (a double of an external HTTP server) on a loopback port from a background thread.

with serve(app) as (url, loop):
    ...                                   # requests to url; loop runs the app's handlers
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from aiohttp import web


@contextlib.contextmanager
def serve(app: web.Application) -> Iterator[tuple[str, asyncio.AbstractEventLoop]]:
    """Run `app` on 127.0.0.1 (a free port) until the block ends; yields its base URL and its event loop."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", loop
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
