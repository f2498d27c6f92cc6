"""The trainer's endpoints (docs/training.md), for an RL trainer in another process: ``POST``
/pause {"mode"}, /resume, /sleep {"level"}, /wake_up {"tags"}, /reset_prefix_cache and
/update_weights {"path", "partial"}; each answers the engine's state (weights version, paused,
sleeping).

Off unless the server is started with ``--enable-training-endpoints``, which also requires an API
key (they change what every client is served). /update_weights reads only checkpoints under
``--training-weights-dir``: the path is resolved (symlinks too) and must lie inside it, so a
client can never make the server read an arbitrary file.
"""
from __future__ import annotations

import os

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asyncengine.errors import WeightUpdateError

from .errors import APIError


class PauseBody(msgspec.Struct, forbid_unknown_fields=True):
    mode: str = "abort"


class SleepBody(msgspec.Struct, forbid_unknown_fields=True):
    level: int = 1


class WakeBody(msgspec.Struct, forbid_unknown_fields=True):
    tags: list[str] | None = None


class UpdateBody(msgspec.Struct, forbid_unknown_fields=True):
    path: str
    partial: bool = False


class TrainingState(msgspec.Struct):
    weights_version: int
    is_paused: bool
    is_sleeping: bool


async def _body(request: Request, kind: type):
    raw = await request.body()
    try:
        return msgspec.json.decode(raw or b"{}", type=kind)
    except msgspec.ValidationError as e:
        raise APIError(400, f"bad request body: {e}") from None
    except msgspec.DecodeError:
        raise APIError(400, "the request body is not JSON") from None


def _state(engine) -> Response:
    st = TrainingState(weights_version=engine.weights_version, is_paused=engine.is_paused,
                       is_sleeping=engine.is_sleeping)
    return Response(msgspec.json.encode(st), media_type="application/json")


def allowed_path(root: str | None, path: str) -> str:
    """``path`` resolved, if it lies under ``root``; else a 400/403 APIError."""
    if root is None:
        raise APIError(403, "this server reads no weights: start it with --training-weights-dir DIR")
    base = os.path.realpath(root)
    real = os.path.realpath(os.path.join(base, path))
    if os.path.commonpath([base, real]) != base:
        raise APIError(403, f"{path!r} is outside the training weights directory")
    if not os.path.exists(real):
        raise APIError(400, f"{path!r} does not exist in the training weights directory")
    return real


async def _answer(engine, call) -> Response:
    """Run one control call; a value it refuses (a bad mode, level, tag or update) is the client's 400."""
    try:
        await call
    except (ValueError, WeightUpdateError) as e:
        raise APIError(400, str(e)) from None
    return _state(engine)


def training_routes(engine, weights_dir: str | None) -> list[Route]:
    async def pause(request: Request) -> Response:
        return await _answer(engine, engine.pause_generation((await _body(request, PauseBody)).mode))

    async def resume(request: Request) -> Response:
        return await _answer(engine, engine.resume_generation())

    async def sleep(request: Request) -> Response:
        return await _answer(engine, engine.sleep((await _body(request, SleepBody)).level))

    async def wake_up(request: Request) -> Response:
        return await _answer(engine, engine.wake_up((await _body(request, WakeBody)).tags))

    async def reset_prefix_cache(request: Request) -> Response:
        return await _answer(engine, engine.reset_prefix_cache())

    async def update_weights(request: Request) -> Response:
        body = await _body(request, UpdateBody)
        path = allowed_path(weights_dir, body.path)
        return await _answer(engine, engine.update_weights(path, partial=body.partial))

    return [Route(f"/{fn.__name__}", fn, methods=["POST"])
            for fn in (pause, resume, sleep, wake_up, reset_prefix_cache, update_weights)]
