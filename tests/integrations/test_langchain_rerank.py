"""The LangChain reranker (integrations/langchain_rerank.py) on a tiny random-weight BERT
cross-encoder: sync and async ``compress_documents`` return the documents best first, cut to
``top_n``, with ``relevance_score`` equal (1e-4) to transformers' sigmoid(logit); an engine the app
runs is used on its own loop."""
from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # a tiny model on a busy 2-core box

pytest.importorskip("langchain_core")

import torch  # noqa: E402
import transformers  # noqa: E402
from langchain_core.documents import Document  # noqa: E402

from asyncengine import AsyncLLMEngine, EngineConfig  # noqa: E402
from asyncengine.integrations.engine_thread import close_shared_engines  # noqa: E402
from asyncengine.integrations.langchain_rerank import AsyncEngineReranker  # noqa: E402
from model_utils import make_tiny_bert  # noqa: E402

OPTIONS = {"dtype": "float32", "device": "cpu", "num_threads": 1, "freeze_gc_after_load": False}
QUERY = "the cat sat"
TEXTS = ["the cat sat on the mat", "a dog", "the sky is blue and big", "cat", "far far ran the dog and the cat"]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("lc-rerank")
    ref = make_tiny_bert(path, "BertForSequenceClassification", seed=5)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        scores = torch.sigmoid(ref(**tok([QUERY] * len(TEXTS), TEXTS, padding=True,
                                          return_tensors="pt")).logits[:, 0]).tolist()
    yield str(path), scores
    close_shared_engines()


def check(out, scores, top_n):
    best = sorted(range(len(TEXTS)), key=lambda i: -scores[i])[:top_n]
    assert [d.page_content for d in out] == [TEXTS[i] for i in best]
    assert [d.metadata["source"] for d in out] == best  # the document's own metadata kept
    for d, i in zip(out, best):
        assert abs(d.metadata["relevance_score"] - scores[i]) < 1e-4


def test_compress_documents_sync_and_async(cross_encoder):
    path, scores = cross_encoder
    docs = [Document(page_content=t, metadata={"source": i}) for i, t in enumerate(TEXTS)]
    rr = AsyncEngineReranker(model=path, engine_options=OPTIONS, top_n=3)
    check(rr.compress_documents(docs, QUERY), scores, 3)
    check(asyncio.run(rr.acompress_documents(docs, QUERY)), scores, 3)
    assert rr.compress_documents([], QUERY) == []
    everything = AsyncEngineReranker(model=path, engine_options=OPTIONS, top_n=None)
    check(everything.compress_documents(docs, QUERY), scores, None)


def test_an_app_engine_on_its_own_loop(cross_encoder):
    path, scores = cross_encoder
    docs = [Document(page_content=t, metadata={"source": i}) for i, t in enumerate(TEXTS)]

    async def run():
        async with AsyncLLMEngine.from_config(EngineConfig(model=path, **OPTIONS)) as eng:
            return await AsyncEngineReranker(engine=eng, top_n=2).acompress_documents(docs, QUERY)

    check(asyncio.run(run()), scores, 2)
