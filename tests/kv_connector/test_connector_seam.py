"""The scheduler side of the KV-connector seam with a test double: blocks held for a transfer
under a lease are freed when the connector reports the transfer done, when the lease runs out
(and the connector is told), and never held for an aborted request; a held id cannot be reused."""
from __future__ import annotations

from asyncengine.core.request import RequestStatus
from asyncengine.contracts.sched_output import ModelRunnerOutput
from asyncengine.kv_connector.base import SchedulerConnector
from asyncengine.contracts.connector_messages import KVConnectorOutput
from sched_oracle import KVOracleRunner, make_req, new_sched

import pytest


class HoldingConnector(SchedulerConnector):
    """Holds every request that finished normally for ``lease_s``; external tokens: none."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self.expired: list[str] = []
        self.finished: list[tuple[str, RequestStatus]] = []

    def get_num_new_matched_tokens(self, req, num_computed):
        return 0, False

    def update_state_after_alloc(self, req, blocks, num_computed, num_external):
        pass

    def build_meta(self, scheduled, requests):
        return None

    def update_connector_output(self, out):
        return [], list(out.finished_sending)

    def request_finished(self, req):
        self.finished.append((req.request_id, req.status))
        return None if req.status == RequestStatus.FINISHED_ABORTED else self.lease_s

    def lease_expired(self, request_id):
        self.expired.append(request_id)


def setup(lease_s: float):
    conn = HoldingConnector(lease_s)
    s = new_sched(num_blocks=16, block_size=4, policy="fcfs", kv_connector=conn)
    return s, conn, KVOracleRunner(s)


def run_until_done(s, runner, report=None):
    for _ in range(200):
        if not s.requests:
            return
        so = s.schedule()
        out = runner.execute(so)
        if report is not None:
            out.kv_connector_output = report
            report = None
        s.update(so, out)
    raise AssertionError("not finished")


def test_held_blocks_are_freed_when_the_transfer_reports_done():
    s, conn, runner = setup(lease_s=60.0)
    s.add_request(make_req("a", list(range(10, 20)), max_tokens=3))
    run_until_done(s, runner)
    st = s.kv_connector_stats()
    assert st["kv_leases_held"] == 1 and st["kv_blocks_held_for_transfer"] == 3  # 12 tokens of 4
    assert s.kv.num_free_blocks == 16 - 3 and s.has_unfinished()
    with pytest.raises(ValueError):
        s.add_request(make_req("a", [5, 6], max_tokens=1))  # its blocks are still someone's
    so = s.schedule()
    s.update(so, ModelRunnerOutput(req_ids=[], sampled_token_ids=[],
                                   kv_connector_output=KVConnectorOutput(finished_sending=["a"])))
    assert s.kv.num_free_blocks == 16 and not s.has_unfinished()
    assert s.kv_connector_stats()["kv_leases_expired"] == 0 and conn.expired == []
    s.kv.pool.check_invariants()


def test_a_lease_that_runs_out_frees_and_tells_the_connector():
    s, conn, runner = setup(lease_s=0.0)
    s.add_request(make_req("b", list(range(10, 19)), max_tokens=2))
    run_until_done(s, runner)
    assert s.kv.num_free_blocks < 16
    s.schedule()  # the next step expires it
    assert s.kv.num_free_blocks == 16 and conn.expired == ["b"]
    assert s.kv_connector_stats()["kv_leases_expired"] == 1 and not s.has_unfinished()
    # a late report for it changes nothing
    s.update(s.schedule(), ModelRunnerOutput(req_ids=[], sampled_token_ids=[],
                                             kv_connector_output=KVConnectorOutput(finished_sending=["b"])))
    assert s.kv.num_free_blocks == 16
    s.kv.pool.check_invariants()


def test_an_aborted_request_is_never_held():
    s, conn, runner = setup(lease_s=60.0)
    s.add_request(make_req("c", list(range(10, 30)), max_tokens=5))
    so = s.schedule()
    s.update(so, runner.execute(so))
    assert s.kv.num_free_blocks < 16
    s.abort_requests(["c"])
    assert conn.finished == [("c", RequestStatus.FINISHED_ABORTED)]
    assert s.kv.num_free_blocks == 16 and not s.has_unfinished()


def test_no_connector_no_metadata():
    s = new_sched(policy="fcfs")
    s.add_request(make_req("d", [5, 6, 7], max_tokens=1))
    so = s.schedule()
    assert so.kv_connector_metadata is None and s.kv_connector_stats() == {}
