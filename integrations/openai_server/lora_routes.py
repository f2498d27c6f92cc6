"""Named LoRA adapters over HTTP, as vLLM serves them (docs/lora.md): ``POST /v1/load_lora_adapter``
{"lora_name", "lora_path"} and ``POST /v1/unload_lora_adapter`` {"lora_name"}; ``/v1/models``
lists each adapter with ``parent`` = the base model. A request's ``model`` naming an adapter runs
under it (state.py: ``resolve_model``). The registry is the engine client's
(engine/lora_registry.py), so every front end (one core, data parallel, P/D) serves the same way.

The two endpoints exist only when the engine runs with ``enable_lora`` (they make the server read
a folder of its own file system: run it with ``--api-key`` where others can reach it). An adapter
that fails the checks (files, rank, shapes against the base model) is a 400 and nothing is
registered."""
from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from asyncengine.errors import InvalidRequestError

from .errors import APIError
from .state import server_state

ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


class LoadBody(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str


class UnloadBody(msgspec.Struct, kw_only=True):
    lora_name: str


def adapter_cards(st, created: int) -> list[dict]:
    """The /v1/models entries of the registered adapters (vLLM's shape: root = the adapter's folder)."""
    return [{"id": lr.name, "object": "model", "created": created, "owned_by": "asyncengine", "root": lr.path,
             "parent": st.model_name, "max_model_len": st.max_model_len} for lr in st.engine.list_loras()]


async def add_adapter(engine, name: str, path: str) -> None:
    """Register one adapter; its checks' failure as a 400 (the body's fields named)."""
    try:
        await engine.add_lora(name, path)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param="lora_path" if "already" not in str(e) else "lora_name") from None


async def load_lora_adapter(request: Request) -> Response:
    st = server_state(request)
    body: LoadBody = await st.read_json(request, LoadBody)
    if body.lora_name == st.model_name:
        raise APIError(400, f"`{body.lora_name}` is the base model's name", param="lora_name")
    await add_adapter(st.engine, body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    st = server_state(request)
    body: UnloadBody = await st.read_json(request, UnloadBody)
    if not await st.engine.remove_lora(body.lora_name):
        raise APIError(404, f"The LoRA adapter `{body.lora_name}` is not loaded.", param="lora_name",
                       code="model_not_found")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def lora_routes() -> list[Route]:
    return [Route(ROUTES[0], load_lora_adapter, methods=["POST"]),
            Route(ROUTES[1], unload_lora_adapter, methods=["POST"])]
