"""The worker's encoder cache (worker/encoder_cache.py): each image encoded once per hash while a
request needs it, sliced to the rows each chunk covers (a chunk may start or end inside an image's
run), released past the run or when the request leaves, and kept within its budget once released."""
from __future__ import annotations

import msgspec
import numpy as np
import torch

from asyncengine.attention.backend import SeqChunk
from asyncengine.contracts.multimodal import MultiModalInput
from asyncengine.worker.encoder_cache import EncoderCache

L = 6  # rows per image


class FakeVision(torch.nn.Module):
    """Row r of image i is (its first pixel + r): every row tells which image and which row it is."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def encode_images(self, px):
        self.calls += 1
        first = px.reshape(px.shape[0], -1)[:, :1]
        return (first + torch.arange(L)).unsqueeze(-1).expand(-1, -1, 2).clone()


def mm(value: float, offset: int) -> MultiModalInput:
    px = np.full((1, 2, 2), value, dtype=np.float32)
    return MultiModalInput(hash=f"h{value}", offset=offset, length=L, data=px.tobytes(), shape=[1, 2, 2])


def chunk(row, start, n):
    return SeqChunk(query_start=row, query_len=n, context_len=start, block_ids=[])


def test_chunks_slice_one_encoding_shared_by_two_requests():
    model = FakeVision()
    cache = EncoderCache(model, torch.device("cpu"), torch.float32, budget_tokens=L)
    cache.add("a", [mm(10.0, 2)], 0)
    cache.add("b", [mm(10.0, 0), mm(20.0, 7)], 0)
    # a: positions 0..3 (rows 0..3: its image's rows 0..1 at flat rows 2..3); b: positions 0..4 at rows 4..8
    rows, feats = cache.step_embeds(["a", "b"], [chunk(0, 0, 4), chunk(4, 0, 5)])
    assert rows.tolist() == [2, 3, 4, 5, 6, 7, 8]
    assert feats[:, 0].tolist() == [10, 11, 10, 11, 12, 13, 14]
    assert model.calls == 1 and cache.num_encoded == 1  # one image, one encoding for both requests
    # next chunks: a 4..9 (its rows 2..5: done), b 5..12 (row 5 of image 1, rows 0..5 of image 2)
    rows, feats = cache.step_embeds(["a", "b"], [chunk(0, 4, 6), chunk(6, 5, 8)])
    assert rows.tolist() == [0, 1, 2, 3, 6, 8, 9, 10, 11, 12, 13]
    assert feats[:, 0].tolist() == [12, 13, 14, 15, 15, 20, 21, 22, 23, 24, 25]
    assert cache.num_encoded == 2
    assert not cache.users  # every request is past every run
    assert sum(t.shape[0] for t in cache.outputs.values()) <= L  # released: held within the budget
    assert cache.step_embeds(["a"], [chunk(0, 10, 1)]) is None  # decodes after the image: nothing


def test_a_request_that_leaves_releases_and_a_prefix_hit_skips():
    cache = EncoderCache(FakeVision(), torch.device("cpu"), torch.float32, budget_tokens=0)
    cache.add("a", [mm(1.0, 0)], 0)
    cache.step_embeds(["a"], [chunk(0, 0, 3)])  # half of its run
    assert cache.users == {"h1.0": {"a"}} and "h1.0" in cache.outputs
    cache.forget("a")  # finished or preempted: released now, evicted at the next step's start
    assert not cache.users and "h1.0" in cache.outputs
    cache.add("b", [mm(1.0, 0)], L + 1)  # a prefix hit past the whole run: never encoded
    assert not cache.users and cache.step_embeds(["b"], [chunk(0, L + 1, 1)]) is None
    assert not cache.outputs and cache.num_encoded == 1


class FakeGridVision(torch.nn.Module):
    """Dynamic resolution: patches [sum t*h*w, 1] and grids in, one row per 2x2 patches out
    (the mean of its four patches' values), concatenated image after image."""

    def __init__(self):
        super().__init__()
        self.grids = []

    def encode_images(self, patches, grid_thw):
        self.grids.append(grid_thw.tolist())
        return patches.reshape(-1, 4).mean(dim=1, keepdim=True)


def grid_mm(value: float, offset: int, grid: list[int]) -> MultiModalInput:
    px = np.full((grid[0] * grid[1] * grid[2], 1), value, dtype=np.float32)
    m = MultiModalInput(hash=f"g{value}", offset=offset, length=px.shape[0] // 4, data=px.tobytes(),
                        shape=list(px.shape), grid_thw=grid)
    # the grid crosses the core boundary with the rest (msgspec)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(m), type=MultiModalInput) == m
    return m


def test_grid_images_of_different_sizes_encode_in_one_call_and_split():
    model = FakeGridVision()
    cache = EncoderCache(model, torch.device("cpu"), torch.float32)
    cache.add("a", [grid_mm(1.0, 1, [1, 2, 6]), grid_mm(2.0, 5, [1, 4, 4])], 0)  # 3 rows, then 4 rows
    rows, feats = cache.step_embeds(["a"], [chunk(0, 0, 8)])
    assert model.grids == [[[1, 2, 6], [1, 4, 4]]]
    assert rows.tolist() == [1, 2, 3, 5, 6, 7]
    assert feats[:, 0].tolist() == [1, 1, 1, 2, 2, 2]
    assert [t.shape[0] for t in cache.outputs.values()] == [3, 4]


def test_a_request_added_as_another_leaves_keeps_their_image():
    """A step that preempts (or finishes) one request and adds another with the same image: the
    output stays for the new one (the scheduler counted it as held, not as encoder work)."""
    model = FakeVision()
    cache = EncoderCache(model, torch.device("cpu"), torch.float32, budget_tokens=0)
    cache.add("a", [mm(3.0, 0)], 0)
    cache.step_embeds(["a"], [chunk(0, 0, 2)])
    cache.forget("a")  # the next step's message: a leaves, b arrives
    cache.add("b", [mm(3.0, 1)], 0)
    rows, feats = cache.step_embeds(["b"], [chunk(0, 0, 4)])
    assert feats[:, 0].tolist() == [3, 4, 5] and model.calls == 1 and cache.max_step_rows == L
