"""Development-mode routes (vLLM's, behind its `VLLM_SERVER_DEV_MODE=1`): a trainer in another
process puts the server's engine to sleep, wakes it, pauses it and resets its prefix cache.

    POST /sleep?level=1|2        free device memory (`LLMEngine.sleep`); 409 with requests running
    POST /wake_up                take it again (`LLMEngine.wake_up`)
    GET  /is_sleeping            {"is_sleeping": bool}
    POST /reset_prefix_cache     forget cached prefixes
    POST /pause?mode=abort|keep  stop scheduling (`LLMEngine.pause_generation`)
    POST /resume                 schedule again
    GET  /is_paused              {"is_paused": bool}

They exist only when the environment variable `DEV_MODE_ENV` is "1" when the app is built: they
change what every client gets, so a production server never has them. They work wherever the
engine runs (`AsyncEngine.control`: on the server's engine thread, or in the engine-core process
of `--engine-process`, the default), between two steps. A refused call is a 400 (a bad argument)
or a 409 (the engine's state forbids it: sleep with requests running, or over several processes).
"""

import asyncio
import os

from fastapi import FastAPI
from starlette.responses import JSONResponse, Response

from jaxpaged.server.async_engine import EngineDeadError, EngineNotReadyError
from jaxpaged.server.data_parallel import EngineClient
from jaxpaged.server.errors import error_body

DEV_MODE_ENV = "JAXPAGED_SERVER_DEV_MODE"  # vLLM's VLLM_SERVER_DEV_MODE


def dev_mode() -> bool:
    """Whether the development-mode routes are on (`DEV_MODE_ENV`=1)."""
    return os.environ.get(DEV_MODE_ENV) == "1"


async def call_control(engine: EngineClient, method: str, *args):
    """`engine.control(method, *args)`'s result, or the error response: 400 for a bad argument
    (ValueError), 409 for a call the engine's state forbids (RuntimeError); a stopped or starting
    engine raises (the app's 503s)."""
    try:
        return await asyncio.wrap_future(engine.control(method, *args))
    except (EngineDeadError, EngineNotReadyError):
        raise
    except ValueError as err:
        return JSONResponse(error_body(str(err), "invalid_request_error"), status_code=400)
    except RuntimeError as err:
        return JSONResponse(error_body(str(err), "conflict"), status_code=409)


def add_dev_routes(app: FastAPI, engine: EngineClient) -> None:
    """Adds the routes of the module docstring to `app`."""

    async def call(method: str, *args):
        return await call_control(engine, method, *args)

    async def done(method: str, *args) -> Response:
        result = await call(method, *args)
        return result if isinstance(result, Response) else Response(status_code=200)

    @app.post("/sleep")
    async def sleep(level: int = 1) -> Response:
        if level == 2:  # an HTTP client could not give the weights back (update_weights takes arrays)
            message = "level=2 discards the weights, which no route gives back; sleep at level 1 over HTTP"
            return JSONResponse(error_body(message, "invalid_request_error", param="level"), status_code=400)
        return await done("sleep", level)

    @app.post("/wake_up")
    async def wake_up() -> Response:
        return await done("wake_up")

    @app.get("/is_sleeping")
    async def is_sleeping():
        result = await call("is_sleeping")
        return result if isinstance(result, Response) else {"is_sleeping": result}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        return await done("reset_prefix_cache")

    @app.post("/pause")
    async def pause(mode: str = "abort") -> Response:
        return await done("pause_generation", mode)

    @app.post("/resume")
    async def resume() -> Response:
        return await done("resume_generation")

    @app.get("/is_paused")
    async def is_paused():
        result = await call("is_paused")
        return result if isinstance(result, Response) else {"is_paused": result}
