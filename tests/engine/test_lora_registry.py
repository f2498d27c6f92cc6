"""The engine client's named adapters (engine/lora_registry.py): a name is taken once, a bad adapter
registers nothing, and an adapter unloaded and loaded again gets a fresh id (the worker's slots and
the prefix cache key adapters by id, so the old one's blocks are never reused for the new one)."""
import asyncio

import pytest

from asyncengine.engine.lora_registry import FIRST_ID, NamedLoRAs
from asyncengine.errors import InvalidRequestError


class Front(NamedLoRAs):
    def _check_lora(self, lora_request) -> None:
        if lora_request.path.startswith("bad"):
            raise InvalidRequestError(f"LoRA adapter {lora_request.path!r}: no such folder")


def test_names_ids_and_refusals():
    async def run():
        f = Front()
        sql = await f.add_lora("sql", "/a/sql")
        assert (sql.name, sql.id, sql.path) == ("sql", FIRST_ID, "/a/sql")
        with pytest.raises(InvalidRequestError, match="already loaded"):
            await f.add_lora("sql", "/a/other")
        with pytest.raises(InvalidRequestError, match="no such folder"):
            await f.add_lora("x", "bad/path")
        with pytest.raises(InvalidRequestError, match="non-empty"):
            await f.add_lora("", "/a/b")
        assert f.list_loras() == [sql] and f.get_lora("x") is None
        assert await f.remove_lora("sql") and not await f.remove_lora("sql")
        again = await f.add_lora("sql", "/a/sql-v2")
        assert again.id not in (sql.id, FIRST_ID + 1) and f.get_lora("sql") == again  # ids never reused
        assert Front().list_loras() == []  # each front end its own registry

    asyncio.run(run())
