"""/metrics: Prometheus text that prometheus_client's own parser reads, with the families an
operator dashboards on, counting what actually happened; one registry per app."""
from __future__ import annotations

import httpx
import prometheus_client
from prometheus_client.parser import text_string_to_metric_families

from asyncengine.integrations.openai_server import build_app
from live_server import MODEL, make_engine

FAMILIES = {
    "asyncengine_http_requests": "counter",
    "asyncengine_time_to_first_token_seconds": "histogram",
    "asyncengine_time_per_output_token_seconds": "histogram",
    "asyncengine_e2e_request_latency_seconds": "histogram",
    "asyncengine_request_queue_time_seconds": "histogram",
    "asyncengine_prompt_tokens": "counter",
    "asyncengine_generation_tokens": "counter",
    "asyncengine_requests_finished": "counter",
    "asyncengine_num_requests_running": "gauge",
    "asyncengine_num_requests_waiting": "gauge",
    "asyncengine_kv_cache_usage_ratio": "gauge",
    "asyncengine_prefix_cache_hit_rate": "gauge",
    "asyncengine_prefix_cache_queries": "counter",
    "asyncengine_prefix_cache_hits": "counter",
}


def scrape(server) -> dict:
    r = httpx.get(server.base_url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(families, name: str, sample: str | None = None, **labels) -> float:
    fam = families.get(name)
    if fam is None:
        return 0.0
    sample = sample or name
    return sum(s.value for s in fam.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_families_and_counts(server, client):
    server.wait_clean()
    before = scrape(server)
    client.completions.create(model=MODEL, prompt="Hello metrics", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "x", "n": 0})
    httpx.get(server.base_url + "/v1/definitely/not/here")
    server.wait_clean()
    after = scrape(server)
    for name, typ in FAMILIES.items():
        assert name in after, f"/metrics lacks {name}"
        assert after[name].type == typ, (name, after[name].type)

    def delta(name, sample=None, **labels):
        return value(after, name, sample, **labels) - value(before, name, sample, **labels)

    reqs = "asyncengine_http_requests"
    assert delta(reqs, reqs + "_total", endpoint="/v1/completions", method="POST", status="200") == 1
    assert delta(reqs, reqs + "_total", endpoint="/v1/completions", method="POST", status="400") == 1
    assert delta(reqs, reqs + "_total", endpoint="other", status="404") == 1  # no label per random path
    for h in ("asyncengine_time_to_first_token_seconds", "asyncengine_time_per_output_token_seconds",
              "asyncengine_e2e_request_latency_seconds", "asyncengine_request_queue_time_seconds"):
        assert delta(h, h + "_count") == 1, h
        assert value(after, h, h + "_bucket", le="+Inf") == value(after, h, h + "_count")
    assert delta("asyncengine_generation_tokens", "asyncengine_generation_tokens_total") == 5
    assert delta("asyncengine_requests_finished", "asyncengine_requests_finished_total", finish_reason="length") == 1
    assert value(after, "asyncengine_num_requests_running") == 0
    assert value(after, "asyncengine_num_requests_waiting") == 0
    assert value(after, "asyncengine_kv_cache_usage_ratio") == 0.0


def test_prefix_cache_metrics_move(server, client):
    prompt = "The quick brown fox jumps over the lazy dog. " * 4  # several full KV blocks
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    before = scrape(server)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    after = scrape(server)
    hits = "asyncengine_prefix_cache_hits"
    assert value(after, hits, hits + "_total") > value(before, hits, hits + "_total")
    assert 0.0 < value(after, "asyncengine_prefix_cache_hit_rate") <= 1.0


def test_each_app_has_its_own_registry(tiny_llama_dir):
    apps = [build_app(make_engine(tiny_llama_dir, num_kv_blocks=8), served_model_name=f"m{i}") for i in range(2)]
    regs = [a.state.server.metrics.registry for a in apps]
    assert regs[0] is not regs[1]
    for reg in regs:
        text = prometheus_client.generate_latest(reg).decode()
        assert "asyncengine_http_requests" in text and "asyncengine_kv_cache_usage_ratio" in text
    # nothing leaks into the process-wide default registry
    assert "asyncengine_" not in prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
