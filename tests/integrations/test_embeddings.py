"""/v1/embeddings (integrations/openai_server/embeddings.py) through the official openai client on
a live server: float and base64 (the client decodes both), a batch of texts and token-id input,
each equal to the last-token pool of transformers' hidden states (fp32, cosine > 0.99999),
``dimensions`` (Matryoshka: truncated, then normalised), and clear 400s."""
from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
import transformers

from live_server import MODEL


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    model = transformers.AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)

    def embed(ids: list[int], dims: int | None = None) -> torch.Tensor:
        with torch.no_grad():
            h = model(torch.tensor([ids])).last_hidden_state[0, -1]
        return F.normalize(h[:dims] if dims else h, dim=-1)

    return tok, embed


def close(got: list[float] | str, ref: torch.Tensor) -> bool:
    if isinstance(got, str):  # base64 asked for by name: the client hands it back as sent
        raw = base64.b64decode(got)
        got = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    g = torch.tensor(got)
    return g.shape == ref.shape and F.cosine_similarity(g, ref, dim=0).item() > 0.99999


@pytest.mark.parametrize("fmt", ["float", "base64", None])  # None: the client asks for base64, decodes it
def test_texts_match_transformers(client, server, hf, fmt):
    tok, embed = hf
    texts = ["a cat sat on the mat", "stock prices fell sharply today", "hi"]
    r = client.embeddings.create(model=MODEL, input=texts, **({"encoding_format": fmt} if fmt else {}))
    assert [d.index for d in r.data] == [0, 1, 2]
    ids = [tok(t)["input_ids"] for t in texts]
    assert r.usage.prompt_tokens == sum(map(len, ids))
    for d, i in zip(r.data, ids):
        assert close(d.embedding, embed(i))
    server.wait_clean()


def test_token_ids_and_dimensions(client, server, hf):
    _, embed = hf
    ids = [[5, 6, 7, 8], [9, 10]]
    r = client.embeddings.create(model=MODEL, input=ids, dimensions=16)
    assert [len(d.embedding) for d in r.data] == [16, 16]
    for d, i in zip(r.data, ids):
        assert close(d.embedding, embed(i, 16))
    one = client.embeddings.create(model=MODEL, input=[5, 6, 7, 8])  # one list of ids: one input
    assert len(one.data) == 1 and close(one.data[0].embedding, embed([5, 6, 7, 8]))
    server.wait_clean()


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 100000}, "dimensions"),
    ({"input": [[5, 6], "mixed"]}, "input"),
])
def test_bad_requests_are_400(server, body, param):
    r = httpx.post(server.base_url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    server.wait_clean()


def test_client_error_type(client):
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input="x", dimensions=100000)


@pytest.mark.parametrize("body", [
    {"input": ["x"] * 257},  # more inputs than max_prompts (256)
    {"input": "word " * 200_000},  # more characters than the prompt limit allows
    {"input": list(range(5, 1100))},  # more token ids than max_model_len (1024)
], ids=["inputs", "chars", "tokens"])
def test_limits_are_400_and_the_server_serves_on(client, server, body):
    r = httpx.post(server.base_url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input" and err["message"], err
    ok = client.embeddings.create(model=MODEL, input="still serving")
    assert len(ok.data) == 1
    server.wait_clean()
