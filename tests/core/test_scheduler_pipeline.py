"""The scheduler under pipeline parallelism (``pipeline_parallel=True``): batches in flight are
disjoint (a request whose step has not come back is neither scheduled nor re-admitted), and each
step of a request carries the tokens sampled since its previous one, for the stages that do not
sample. No model: the steps' results are made up."""
from __future__ import annotations

from asyncengine.config import EngineConfig
from asyncengine.core.kv_cache_manager import KVCacheManager
from asyncengine.core.request import Request
from asyncengine.contracts.sched_output import ModelRunnerOutput, SchedulerOutput
from asyncengine.core.scheduler import Scheduler
from asyncengine.sampling_params import SamplingParams


SCHED = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64).scheduler_config


def req(rid: str, prompt_len: int, max_tokens: int) -> Request:
    first = 3 + 50 * (ord(rid[0]) - ord("a"))  # no two requests share a prefix
    return Request(request_id=rid, prompt_token_ids=list(range(first, first + prompt_len)),
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
                   max_tokens=max_tokens)


def sampled(so: SchedulerOutput, tok: dict[str, int], sched: Scheduler) -> ModelRunnerOutput:
    """What the last stage returns: one token for each request whose step reached its end."""
    ids = [rid for rid in so.num_scheduled_tokens
           if rid in sched.requests and sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens]
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[tok[r]] for r in ids])


def test_batches_in_flight_are_disjoint_and_carry_the_sampled_tokens():
    s = Scheduler(KVCacheManager(64, 4, True), SCHED, max_model_len=256, pipeline_parallel=True)
    s.add_request(req("a", 5, 3))
    so1 = s.schedule()  # a's prompt
    s.add_request(req("b", 6, 3))
    so2 = s.schedule()  # a is in the pipe: b alone
    assert so1.num_scheduled_tokens == {"a": 5} and so2.num_scheduled_tokens == {"b": 6}
    assert s.schedule().is_empty  # both in flight: nothing more to schedule
    s.update(so1, sampled(so1, {"a": 100}, s))
    so3 = s.schedule()
    assert so3.num_scheduled_tokens == {"a": 1}
    assert [(c.req_id, c.new_token_ids) for c in so3.cached_requests] == [("a", [100])]
    s.update(so2, sampled(so2, {"b": 200}, s))
    s.update(so3, sampled(so3, {"a": 101}, s))
    so4 = s.schedule()  # both back: one decode each, with exactly the tokens not sent before
    assert so4.num_scheduled_tokens == {"a": 1, "b": 1}
    assert sorted((c.req_id, c.new_token_ids) for c in so4.cached_requests) == [("a", [101]), ("b", [200])]
    s.update(so4, sampled(so4, {"a": 102, "b": 201}, s))
    outs = s.requests  # a reached max_tokens=3 and finished; b has two
    assert "a" not in outs and outs["b"].output_token_ids == [200, 201]


def test_a_preempted_request_in_flight_waits_for_its_step():
    """A request preempted while its step is in the pipe is not re-admitted until the step is back;
    then it comes back as a new request with all its tokens (every stage rebuilds it)."""
    kv = KVCacheManager(4, 4, False)  # 4 blocks of 4 tokens
    s = Scheduler(kv, SCHED, max_model_len=64, pipeline_parallel=True)
    s.add_request(req("a", 8, 20))  # 2 blocks
    so1 = s.schedule()
    s.add_request(req("b", 8, 20))  # 2 blocks: the cache is full
    so2 = s.schedule()
    assert so1.num_scheduled_tokens == {"a": 8} and so2.num_scheduled_tokens == {"b": 8}
    s.update(so1, sampled(so1, {"a": 100}, s))
    s.update(so2, sampled(so2, {"b": 200}, s))
    for i in range(8):  # decodes until a block runs out and one request is preempted
        so = s.schedule()
        if so.num_preempted:
            break
        s.update(so, sampled(so, {"a": 101 + i, "b": 201 + i}, s))
    victim = next(r for r in ("a", "b") if r not in so.num_scheduled_tokens)
    survivor = ({"a", "b"} - {victim}).pop()
    assert victim in so.finished_req_ids
    # the survivor's step is in flight; the victim waits, and nothing else can run
    assert s.schedule().is_empty
    s.update(so, sampled(so, {"a": 150, "b": 250}, s))
    nxt = s.schedule()
    assert survivor in nxt.num_scheduled_tokens
    for c in nxt.cached_requests:
        assert c.new_token_ids == [150 if c.req_id == "a" else 250]
