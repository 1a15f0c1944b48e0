"""The demo server shared by the server test modules (one engine for the whole session).

The session's `demo_server` fixture (tests/conftest.py) takes the "demo-server" engine of
tests/shared_engines.py and puts one `AsyncEngine` in front of it. A module serves its own app
(its API key, limits, served names) over that engine on a loopback port of its own:

    @pytest.fixture(scope="module")
    def server(demo_server):
        served = demo_server.serve(api_key="sk-x")
        yield served
        served.close()  # stops this module's uvicorn; the engine goes on for the next module

A module leaves the engine as it found it: nothing running or waiting, the gate open. The engine
is shut down once, when the session ends.
"""

import socket
import threading
import time

import uvicorn

from jaxpaged.server.app import build_app
from jaxpaged.server.async_engine import AsyncEngine

MAX_NUM_WAITING = 6000  # the hardening flood queues 2,000 requests


class Served:
    """One module's app over the shared engine, behind uvicorn on a free loopback port."""

    def __init__(self, async_engine: AsyncEngine, model_name, uvicorn_options: dict, app_options: dict):
        self.async_engine = async_engine
        self.app = build_app(async_engine, model_name, **app_options)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app, **{"log_level": "warning", **uvicorn_options}))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.uvicorn.started, "uvicorn did not start"

    @property
    def ctx(self):
        return self.app.state.ctx

    def close(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(15)


class DemoServer:
    """The demo engine behind one `AsyncEngine`, with a gate that can hold its steps."""

    def __init__(self, llm):
        self.llm = llm
        engine = llm.llm_engine
        self.gate = threading.Event()
        self.gate.set()
        step = engine.step
        engine.step = lambda: (self.gate.wait(60), step())[1]
        self.async_engine = AsyncEngine(engine, max_num_waiting=MAX_NUM_WAITING)

    def serve(self, model_name="demo", uvicorn_options: dict | None = None, **app_options) -> Served:
        """This engine behind a new app (`build_app`'s options) on a port of its own."""
        return Served(self.async_engine, model_name, uvicorn_options or {}, app_options)

    def close(self) -> None:
        self.gate.set()
        self.async_engine.shutdown()
