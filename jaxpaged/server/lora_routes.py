"""LoRA adapters on the server (vLLM's surface): `--lora-modules` names adapters at start-up,
a request's `model` picks one (`ServingContext.check_model`), `/v1/models` lists them with the
base model as their parent, and with `lora_modules.RUNTIME_LORA_ENV` set two routes change them while serving:

    POST /v1/load_lora_adapter    {"lora_name": ..., "lora_path": ...}: read and checked now (400
                                  naming what is wrong), then servable by that name
    POST /v1/unload_lora_adapter  {"lora_name": ...}: new requests naming it get 404; requests
                                  already running finish with it

They change what every client may ask for, so they exist only when the variable is set (vLLM's
rule).
"""

import asyncio

from fastapi import FastAPI, Request
from pydantic import BaseModel
from starlette.responses import JSONResponse, Response

from jaxpaged.lora_request import LoRARequest
from jaxpaged.server.dev_routes import call_control
from jaxpaged.server.errors import error_body
from jaxpaged.server.serving_context import ServingContext


class LoadLoraRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoraRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name decides here


def add_lora_routes(app: FastAPI, ctx: ServingContext) -> None:
    """Adds the load and unload routes of the module docstring to `app`."""
    lock = asyncio.Lock()  # loads and unloads one at a time: ids and names stay consistent

    @app.post("/v1/load_lora_adapter")
    async def load(raw: Request) -> Response:
        body = LoadLoraRequest.model_validate(await raw.json())
        async with lock:
            if body.lora_name in ctx.lora_modules or body.lora_name in ctx.model_names:
                message = f"The lora adapter '{body.lora_name}' has already been loaded."
                return JSONResponse(error_body(message, "invalid_request_error"), status_code=400)
            ids = [r.lora_int_id for r in ctx.lora_modules.values()]
            request = LoRARequest(body.lora_name, max(ids, default=0) + 1, body.lora_path)
            result = await call_control(ctx.engine, "add_lora", request)
            if isinstance(result, Response):
                return result
            ctx.lora_modules[body.lora_name] = request
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", status_code=200)

    @app.post("/v1/unload_lora_adapter")
    async def unload(raw: Request) -> Response:
        body = UnloadLoraRequest.model_validate(await raw.json())
        async with lock:
            if body.lora_name not in ctx.lora_modules:
                message = f"The lora adapter '{body.lora_name}' cannot be found."
                return JSONResponse(error_body(message, "not_found_error"), status_code=404)
            del ctx.lora_modules[body.lora_name]
            result = await call_control(ctx.engine, "remove_lora", body.lora_name)
            if isinstance(result, Response):
                return result
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", status_code=200)
