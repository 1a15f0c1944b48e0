"""The profiler's routes (vLLM's), present only with `--profiler-dir DIR`:

    POST /start_profile   start a `jax.profiler` trace of the engine's process into DIR
                          (`LLMEngine.start_profile`; 409 while one runs)
    POST /stop_profile    stop it and write it: {"profile_dir": the run's directory} (409 with none)

Like the development routes they run between two steps, wherever the engine runs (its thread,
or the engine-core process). Profile a few requests only: a trace grows with every step.
"""

from fastapi import FastAPI
from starlette.responses import Response

from jaxpaged.server.data_parallel import EngineClient
from jaxpaged.server.dev_routes import call_control


def add_profile_routes(app: FastAPI, engine: EngineClient, profiler_dir: str) -> None:
    """Adds the routes of the module docstring to `app`, tracing into `profiler_dir`."""

    @app.post("/start_profile")
    async def start_profile():
        result = await call_control(engine, "start_profile", profiler_dir)
        return result if isinstance(result, Response) else Response(status_code=200)

    @app.post("/stop_profile")
    async def stop_profile():
        result = await call_control(engine, "stop_profile")
        return result if isinstance(result, Response) else {"profile_dir": result}
