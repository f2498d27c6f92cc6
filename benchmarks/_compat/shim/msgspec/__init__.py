"""A minimal pure-Python stand-in for msgspec, used ONLY by benchmarks/gpu_check.py on a machine
where msgspec is not installed and cannot be (no network). Structs become dataclasses and
msgpack becomes pickle: enough for the in-process engine, not a replacement for the real thing."""
from __future__ import annotations

import dataclasses
import pickle

__all__ = ["Struct", "msgpack", "structs", "field"]


def field(*, default=dataclasses.MISSING, default_factory=dataclasses.MISSING, name=None):
    return dataclasses.field(default=default, default_factory=default_factory)


class Struct:
    def __init_subclass__(cls, kw_only: bool = False, **options) -> None:
        super().__init_subclass__()
        for name in cls.__dict__.get("__annotations__", {}):
            v = cls.__dict__.get(name, dataclasses.MISSING)
            if isinstance(v, (list, dict, set)):  # msgspec copies mutable defaults; dataclasses refuse them
                setattr(cls, name, dataclasses.field(default_factory=(lambda v=v: type(v)(v))))
        dataclasses.dataclass(cls, kw_only=kw_only)
        cls.__struct_fields__ = tuple(f.name for f in dataclasses.fields(cls))


class _Msgpack:
    class Encoder:
        def encode(self, obj) -> bytes:
            return pickle.dumps(obj)

    class Decoder:
        def __init__(self, type=None) -> None:
            self.type = type

        def decode(self, data: bytes):
            return pickle.loads(data)


class _Structs:
    replace = staticmethod(dataclasses.replace)


msgpack = _Msgpack()
structs = _Structs()
