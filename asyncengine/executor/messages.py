"""The step protocol between an executor and its workers: msgspec messages, encoded once per step.

Every rank gets the same ``ExecuteModel`` bytes (the SchedulerOutput: ids, block ids, sampling
params; never a tensor), runs the step, and rank 0 alone answers with the ModelRunnerOutput.
Control calls (``RPC``) are rare and carry pickled arguments (or a picklable function); each rank
answers them. A rank that fails answers ``Error`` and, for a failed step, exits: its peers may be
blocked in a collective that can never complete, and their process group then fails them too.
"""
from __future__ import annotations

import pickle
from typing import Any, Union

import msgspec

from asyncengine.contracts.sched_output import ModelRunnerOutput, SchedulerOutput


class ExecuteModel(msgspec.Struct, tag="exec"):
    scheduler_output: SchedulerOutput


class RPC(msgspec.Struct, tag="rpc"):
    method: str  # a Worker method name, or "" when `function` holds a pickled function
    payload: bytes  # pickle of (function or None, args, kwargs)


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Ready(msgspec.Struct, tag="ready"):
    rank: int
    pid: int


class StepResult(msgspec.Struct, tag="out"):
    output: ModelRunnerOutput


class RPCResult(msgspec.Struct, tag="rpc_result"):
    payload: bytes  # pickle of the result


class Error(msgspec.Struct, tag="error"):
    rank: int
    message: str
    traceback: str
    fatal: bool  # the rank is exiting: the executor is dead


Request = Union[ExecuteModel, RPC, Shutdown]
Reply = Union[Ready, StepResult, RPCResult, Error]

_enc = msgspec.msgpack.Encoder()
_req_dec = msgspec.msgpack.Decoder(Request)
_reply_dec = msgspec.msgpack.Decoder(Reply)


def encode(msg) -> bytes:
    return _enc.encode(msg)


def decode_request(b: bytes):
    return _req_dec.decode(b)


def decode_reply(b: bytes):
    return _reply_dec.decode(b)


def make_rpc(method, args: tuple, kwargs: dict | None) -> RPC:
    if isinstance(method, str):
        return RPC(method=method, payload=pickle.dumps((None, args, kwargs or {})))
    return RPC(method="", payload=pickle.dumps((method, args, kwargs or {})))


def run_rpc(worker, msg: RPC) -> Any:
    fn, args, kwargs = pickle.loads(msg.payload)
    if fn is None:
        return getattr(worker, msg.method)(*args, **kwargs)
    return fn(worker, *args, **kwargs)
