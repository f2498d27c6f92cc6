"""Named LoRA adapters of a front end (the OpenAI server's ``model`` names, ``--lora-modules``,
``/v1/load_lora_adapter``): a name -> LoRARequest map each front end keeps, as vLLM's serving layer
does. Ids are handed out once and never reused, so an adapter unloaded and loaded again under the
same name (perhaps from another folder) never meets the old one's slot or prefix-cache blocks.
Registry ids start high (``FIRST_ID``) so that they do not meet the ids callers give their own
LoRARequests on the same engine."""
from __future__ import annotations

import asyncio
import itertools

from asyncengine.errors import InvalidRequestError
from asyncengine.lora_request import LoRARequest

FIRST_ID = 1 << 30


class NamedLoRAs:
    """The EngineClient's adapter registry (engine/protocol.py). A front end that mixes it in
    defines ``_check_lora(lora_request)``: raise InvalidRequestError for an adapter it cannot serve."""

    _lora_names: dict[str, LoRARequest]

    def _named(self) -> dict[str, LoRARequest]:
        if "_lora_names" not in self.__dict__:
            self._lora_names = {}
            self._lora_ids = itertools.count(FIRST_ID)
        return self._lora_names

    def _check_lora(self, lora_request: LoRARequest) -> None:
        raise NotImplementedError

    async def add_lora(self, name: str, path: str) -> LoRARequest:
        """Register the PEFT adapter at ``path`` under ``name``: its files are checked first (off the
        loop: a header is read), and a bad one (or a name taken) raises InvalidRequestError with
        nothing registered."""
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise InvalidRequestError("a LoRA adapter needs a non-empty name and path")
        named = self._named()
        if name in named:
            raise InvalidRequestError(f"the LoRA adapter {name!r} is already loaded")
        lr = LoRARequest(name, next(self._lora_ids), path)
        await asyncio.to_thread(self._check_lora, lr)
        if name in named:  # loaded by another caller while this one was checked
            raise InvalidRequestError(f"the LoRA adapter {name!r} is already loaded")
        named[name] = lr
        return lr

    async def remove_lora(self, name: str) -> bool:
        """Forget ``name`` (False: no such adapter). Requests already running under it finish; the
        worker's copy leaves host memory and its slot by the usual LRU."""
        return self._named().pop(name, None) is not None

    def list_loras(self) -> list[LoRARequest]:
        return list(self._named().values())

    def get_lora(self, name: str) -> LoRARequest | None:
        return self._named().get(name)
