"""The host LRU of lora/slots.py: a new adapter is never the one evicted, even when every other
adapter in host memory holds a device slot (max_cpu_loras == max_loras, a third adapter arrives)."""
from asyncengine.lora.peft_adapter import LoRAAdapter
from asyncengine.lora.slots import LoRASlots


def _adapter(i: int) -> LoRAAdapter:
    return LoRAAdapter(name=f"a{i}", id=i, rank=4, weights={})


def test_a_new_adapter_survives_when_the_others_hold_slots():
    slots = LoRASlots([], max_loras=2, max_cpu_loras=2)
    for i in (1, 2):
        slots.add(_adapter(i))
    slots.activate({1, 2})
    slots.add(_adapter(3))
    assert 3 in slots.host  # before the fix: evicted at once, and the step failed "not loaded"
    assert set(slots.activate({3})) == {3}
    slots.add(_adapter(4))  # the host is back within max_cpu_loras once a slotted one is free
    assert 4 in slots.host and len(slots.host) == 3 and 1 not in slots.host


def test_lru_evicts_an_adapter_without_a_slot_first():
    slots = LoRASlots([], max_loras=1, max_cpu_loras=2)
    for i in (1, 2):
        slots.add(_adapter(i))
    slots.activate({1})
    slots.add(_adapter(3))
    assert list(slots.host) == [1, 3]


def test_bt_holds_the_diagonal_blocks_of_b_transposed():
    """What the native step reads (kernels/cpu/lora.c): per part, B's block transposed in the part's
    own columns, and the adapter's rank; refilled in place (the C step keeps the pointers)."""
    import torch

    from asyncengine.lora.slots import LinearSlots

    ls = LinearSlots(0, [("q_proj", 6), ("k_proj", 4), ("v_proj", 4)], 8, max_loras=2, max_rank=4,
                     device=torch.device("cpu"), dtype=torch.float32)
    ptrs = (ls.a.data_ptr(), ls.bt.data_ptr(), ls.rank.data_ptr())
    q, v = (torch.randn(3, 8), torch.randn(6, 3)), (torch.randn(3, 8), torch.randn(4, 3))
    assert ls.fill(1, LoRAAdapter(name="x", id=1, rank=3, weights={(0, "q_proj"): q, (0, "v_proj"): v}))
    assert ls.rank.tolist() == [0, 3]
    assert torch.equal(ls.bt[1, :3, 0:6], q[1].t()) and torch.equal(ls.bt[1, :3, 10:14], v[1].t())
    assert not ls.bt[1, :, 6:10].any() and not ls.bt[1, 3:].any() and not ls.bt[0].any()
    for p, (c0, c1) in enumerate([(0, 6), (6, 10), (10, 14)]):  # b's diagonal blocks: the same product
        assert torch.equal(ls.bt[1, :, c0:c1], ls.b[1, c0:c1, 4 * p:4 * p + 4].t())
    ls.fill(1, None)
    assert ls.rank.tolist() == [0, 0] and not ls.bt.any()
    assert (ls.a.data_ptr(), ls.bt.data_ptr(), ls.rank.data_ptr()) == ptrs
