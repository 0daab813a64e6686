"""Running the server: for good (`serve`), or in a background thread (`serving`: tests, loads)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI

from delspec.errors import ConfigError, is_integer
from delspec.server.app import create_app

if TYPE_CHECKING:
    from delspec.weights.loading import LoadedModel


@contextmanager
def serving(app: FastAPI, host: str = "127.0.0.1") -> Iterator[str]:
    """Serves `app` on `host` (a free port) in a background thread; yields the base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(60)


def serve(lm: LoadedModel, host: str = "127.0.0.1", port: int = 8000, **app_options: Any) -> None:
    """Serve `lm` over HTTP until interrupted; `app_options` go to `create_app`. `ConfigError`
    for a port outside 0..65535 (0: any free one)."""
    if not is_integer(port) or not 0 <= port <= 65535:
        raise ConfigError(f"port must be an integer in 0..65535, got {port!r}")
    uvicorn.run(create_app(lm, **app_options), host=host, port=port)
