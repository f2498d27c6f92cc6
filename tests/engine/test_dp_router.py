"""Prefix-affinity routing of data-parallel requests (engine/dp_router.py), without processes: a
prompt goes to the core that was sent its longest prefix of full blocks, unless that core is
busier than the least loaded one by more than the slack; short or new prompts go to the least
loaded core. The end-to-end check (a prefix-cache hit on the chosen core) is in
test_data_parallel.py."""
from __future__ import annotations

from asyncengine.engine.dp_router import PrefixAffinityRouter, prefix_hashes

BS = 4
SYS = list(range(100, 112))  # three full blocks


def test_follows_the_longest_prefix():
    r = PrefixAffinityRouter(3, BS, slack=2)
    assert r.pick(SYS + [1, 2], None, [0, 0, 0]) == 0  # new: least loaded (lowest index on a tie)
    assert r.pick(SYS[:8] + [7, 7, 7, 7], None, [1, 0, 0]) == 0  # two blocks match core 0
    assert r.pick([9] * 12, None, [1, 0, 0]) == 1  # no match: least loaded
    assert r.pick([9] * 8 + [5] * 4, None, [1, 1, 0]) == 1  # core 1 holds its first two blocks
    assert r.pick(SYS[:4] + [3] * 8, None, [1, 1, 0]) == 0  # one block matches: still beats idle core 2
    assert r.pick([9] * 4 + SYS[4:], None, [2, 1, 0]) == 1  # the chain: only block 0 matches (core 1)
    assert r.pick(SYS + [8], None, [2, 1, 0]) == 0  # all three blocks on core 0
    assert r.num_affinity_routed == 5


def test_busy_core_and_short_prompts_fall_back_to_least_loaded():
    r = PrefixAffinityRouter(2, BS, slack=2)
    assert r.pick(SYS, None, [0, 0]) == 0
    assert r.pick(SYS, None, [2, 0]) == 0  # within the slack
    assert r.pick(SYS, None, [3, 0]) == 1  # 3 > 0 + 2: too busy, the least loaded core instead
    r2 = PrefixAffinityRouter(2, BS, slack=2)
    assert r2.pick([1, 2, 3], None, [0, 0]) == 0
    assert r2.pick([1, 2, 3], None, [1, 0]) == 1  # shorter than a block: nothing to reuse


def test_salt_and_capacity():
    r = PrefixAffinityRouter(2, BS, slack=8, capacity=3)
    assert r.pick(SYS, "alice", [0, 0]) == 0
    assert r.pick(SYS, "bob", [1, 0]) == 1  # another salt: another cache namespace, no match
    assert r.pick(SYS, "alice", [1, 5]) == 0
    assert prefix_hashes(SYS, BS, None, 2) == prefix_hashes(SYS + [1], BS, None, 2)
    assert len(prefix_hashes(SYS, BS, None, 64)) == 3
    r.pick([50] * 12, None, [0, 9])  # three new hashes on core 0: alice's are forgotten
    assert r.pick(SYS, "alice", [1, 0]) == 1
