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
