"""Multi-LoRA admission: at most ``max_loras`` distinct adapters among the running requests, so that
every step's adapters fit the device slots. A request whose adapter would be one too many waits in
the queue (taking no batch slot and no KV block) until a running request of another adapter ends;
the requests behind it (the base model, running adapters) are admitted past it meanwhile, and it
keeps its place at the front (:func:`put_back`)."""
from __future__ import annotations

from asyncengine.core.request import Request


def too_many_loras(req: Request, running: list[Request], max_loras: int | None) -> bool:
    if max_loras is None or req.lora_request is None:
        return False
    lora_id = req.lora_request.id
    ids = {r.lora_request.id for r in running if r.lora_request is not None}
    return lora_id not in ids and len(ids) >= max_loras


def put_back(waiting, skipped: list[Request]) -> None:
    """Requests set aside this step for their adapter return where they were: the front of a
    first-come queue (in their order), their rank in a priority queue."""
    push = getattr(waiting, "push_front", None)
    for req in reversed(skipped):
        if push is not None:
            push(req)
        else:
            waiting.add(req)
