"""/v1/score and /v1/rerank (integrations/openai_server/rerank.py) on a live server around a tiny
random-weight BERT cross-encoder (fp32), through a real HTTP client (httpx) on 127.0.0.1: scores
equal transformers' sigmoid(logit) within 1e-4, in vLLM's score shape and the Jina/Cohere rerank
shape (sorted, top_n, return_documents); clear 400s for bad input and for a generative model."""
from __future__ import annotations

import httpx
import pytest
import torch
import transformers

from live_server import MODEL, LiveServer
from asyncengine import AsyncLLMEngine, EngineConfig
from model_utils import make_tiny_bert

QUERY = "the cat sat"
DOCS = ["the cat sat on the mat", "a dog", "the sky is blue and big", "cat", "far far ran the dog and the cat"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    path = tmp_path_factory.mktemp("rerank-bert")
    ref = make_tiny_bert(path, "BertForSequenceClassification", seed=7)
    tok = transformers.AutoTokenizer.from_pretrained(path)

    def scores(queries, docs) -> list[float]:
        with torch.no_grad():
            return torch.sigmoid(ref(**tok(queries, docs, padding=True, return_tensors="pt")).logits[:, 0]).tolist()

    engine = AsyncLLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", num_threads=1,
                                         freeze_gc_after_load=False))
    server = LiveServer(engine).start()
    yield server, scores, tok
    server.stop()


@pytest.fixture(scope="module")
def http(bert):
    with httpx.Client(base_url=bert[0].base_url + "/v1", timeout=60) as c:
        yield c


def test_score_one_against_many_and_pairwise(bert, http):
    server, scores, tok = bert
    r = http.post("/score", json={"model": MODEL, "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    assert body["usage"]["prompt_tokens"] == sum(len(tok(QUERY, d)["input_ids"]) for d in DOCS)
    torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]),
                               torch.tensor(scores([QUERY] * len(DOCS), DOCS)), rtol=0, atol=1e-4)
    queries = ["dog", "sky", "mat", "a cat", "far"]
    r = http.post("/score", json={"text_1": queries, "text_2": DOCS})
    torch.testing.assert_close(torch.tensor([d["score"] for d in r.json()["data"]]),
                               torch.tensor(scores(queries, DOCS)), rtol=0, atol=1e-4)
    server.wait_clean()


def test_rerank_sorts_and_cuts(bert, http):
    server, scores, _ = bert
    want = scores([QUERY] * len(DOCS), DOCS)
    best = sorted(range(len(DOCS)), key=lambda i: -want[i])
    r = http.post("/rerank", json={"model": MODEL, "query": QUERY, "documents": DOCS, "top_n": 3})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == best[:3]
    assert [x["document"]["text"] for x in results] == [DOCS[i] for i in best[:3]]
    for x in results:
        assert abs(x["relevance_score"] - want[x["index"]]) < 1e-4
    # Cohere's documents as objects, its /v2 path, no documents back
    r = httpx.post(server.base_url + "/v2/rerank", timeout=60, json={
        "query": QUERY, "documents": [{"text": d} for d in DOCS], "return_documents": False})
    assert [x["index"] for x in r.json()["results"]] == best
    assert all("document" not in x for x in r.json()["results"])
    server.wait_clean()


@pytest.mark.parametrize("path,body,param", [
    ("/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/rerank", {"query": QUERY, "documents": [3]}, "documents"),
    ("/rerank", {"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
    ("/rerank", {"query": QUERY, "documents": [" ".join(["cat"] * 80)]}, "documents"),
    ("/score", {"text_1": ["a", "b"], "text_2": DOCS}, "text_1"),
    ("/score", {"text_1": QUERY, "text_2": []}, "text_2"),
    ("/rerank", {"query": QUERY, "documents": ["d"] * 257}, "documents"),  # over max_prompts pairs
    ("/score", {"text_1": QUERY, "text_2": ["d"] * 257}, "text_2"),
    ("/rerank", {"query": QUERY, "documents": ["word " * 200_000]}, "documents"),  # over the characters
])
def test_bad_input_is_a_400_naming_the_field(bert, http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    bert[0].wait_clean()


def test_a_generative_model_cannot_rerank(server):
    r = httpx.post(server.base_url + "/v1/rerank", json={"query": "a", "documents": ["b"]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "cannot rerank" in r.json()["error"]["message"]


def test_the_openapi_document_describes_both(bert):
    doc = httpx.get(bert[0].base_url + "/openapi.json", timeout=60).json()
    for path, required in (("/v1/score", ["text_1", "text_2"]), ("/v1/rerank", ["query", "documents"])):
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert schema["required"] == required
