"""M-RoPE positions (worker/mrope_positions.py) equal transformers' ``get_rope_index`` for any
chunk of a prompt with images of several grids, and decode positions continue at ``p + delta``
(transformers' ``rope_deltas``); a step without image requests gets None (plain RoPE)."""
from __future__ import annotations

import types

import torch

from asyncengine.attention.backend import SeqChunk
from asyncengine.contracts.multimodal import MultiModalInput
from asyncengine.worker.mrope_positions import request_positions, step_positions

MERGE, IMAGE = 2, 99


def _prompt():
    """ids with two image runs (grids 4x12 and 6x2 patches: 12 and 3 rows) and their inputs."""
    ids, inputs = [5, 6, 7], []
    for grid in ([1, 4, 12], [1, 6, 2]):
        n = grid[0] * grid[1] * grid[2] // MERGE ** 2
        inputs.append(MultiModalInput(hash=str(grid), offset=len(ids), length=n, data=b"", shape=[0, 0],
                                      grid_thw=grid))
        ids += [IMAGE] * n + [8, 9]
    return ids, inputs


def _reference(ids, inputs):
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    fake = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=MERGE)),
        get_vision_position_ids=lambda *a, **k: Qwen2VLModel.get_vision_position_ids(None, *a, **k))
    input_ids = torch.tensor([ids])
    types_ = (input_ids == IMAGE).int()
    grids = torch.tensor([m.grid_thw for m in inputs])
    pos, delta = Qwen2VLModel.get_rope_index(fake, input_ids, types_, image_grid_thw=grids)
    return pos[:, 0], int(delta)


def test_every_chunk_matches_transformers_and_decode_continues_at_delta():
    ids, inputs = _prompt()
    ref, delta = _reference(ids, inputs)
    n = len(ids)
    assert request_positions(inputs, 0, n) == ref.tolist()
    for start, stop in [(0, 4), (4, 9), (9, 17), (17, n), (2, 3), (16, 19)]:  # chunks cut inside the runs
        assert request_positions(inputs, start, stop) == ref[:, start:stop].tolist()
    assert delta != 0
    for p in (n, n + 5):
        assert request_positions(inputs, p, p + 1) == [[p + delta]] * 3
    assert request_positions([], 4, 6) == [[4, 5]] * 3


def test_step_positions_mixes_image_and_text_requests():
    ids, inputs = _prompt()
    ref, _ = _reference(ids, inputs)
    seqs = [SeqChunk(query_start=0, query_len=1, context_len=7, block_ids=[]),  # a text-only decode
            SeqChunk(query_start=1, query_len=6, context_len=2, block_ids=[])]
    out = step_positions(["text", "img"], seqs, {"img": inputs}, torch.device("cpu"))
    assert out[:, 0].tolist() == [7, 7, 7]
    assert torch.equal(out[:, 1:], ref[:, 2:8])
    assert step_positions(["text"], seqs[:1], {"img": inputs}, torch.device("cpu")) is None
