"""The LlamaIndex embedding (integrations/llamaindex_embeddings.py) on a tiny random-weight Llama
with a tokenizer: the public sync and async entry points (text, query, batch) give ``LLM.embed``'s
vectors for the same texts (fp32, cosine > 0.99999); pooling, dimensions and the prefixes reach the
engine; an engine the app runs is used on its own loop with every KV block free after."""
from __future__ import annotations

import pytest

pytest.importorskip("llama_index.core")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from asyncengine import LLM, AsyncLLMEngine, EngineConfig  # noqa: E402
from asyncengine.integrations.engine_thread import close_shared_engines  # noqa: E402
from asyncengine.integrations.llamaindex_embeddings import AsyncEngineEmbedding  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
OPTIONS = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 256, "num_threads": 1,
           "freeze_gc_after_load": False}
DOCS = ["a cat sat on the mat", "stock prices fell sharply today", "hello", "the quick brown fox jumps"]


@pytest.fixture(autouse=True, scope="module")
def _close_engines():
    """The engines these tests built (shared per model) are shut down with the module."""
    yield
    close_shared_engines()


def assert_same(got, refs) -> None:
    assert len(got) == len(refs)
    for g, r in zip(got, refs):
        g, r = torch.tensor(g), torch.tensor(r)
        assert g.shape == r.shape
        assert F.cosine_similarity(g, r, dim=0).item() > 0.99999


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> dict:
    with LLM(tiny_llama_dir, **OPTIONS) as llm:
        return {"last": llm.embed(DOCS), "mean16": llm.embed(["Doc: " + t for t in DOCS[:2]], pooling="mean",
                                                             dimensions=16),
                "query": llm.embed(["Query: cats"], pooling="mean", dimensions=16)}


async def test_sync_and_async_entry_points_equal_llm_embed(tiny_llama_dir, reference):
    emb = AsyncEngineEmbedding(model=tiny_llama_dir, engine_options=OPTIONS, embed_batch_size=3)
    assert emb.model_name == tiny_llama_dir
    ref = reference["last"]
    assert_same(emb.get_text_embedding_batch(DOCS), ref)  # two batches: 3 + 1
    assert_same([emb.get_text_embedding(DOCS[0]), emb.get_query_embedding(DOCS[1])], ref[:2])
    assert_same(await emb.aget_text_embedding_batch(DOCS), ref)
    assert_same([await emb.aget_text_embedding(DOCS[2]), await emb.aget_query_embedding(DOCS[3])], ref[2:])


def test_pooling_dimensions_and_prefixes(tiny_llama_dir, reference):
    emb = AsyncEngineEmbedding(model=tiny_llama_dir, engine_options=OPTIONS, pooling="mean", dimensions=16,
                               query_prefix="Query: ", document_prefix="Doc: ")
    docs = emb.get_text_embedding_batch(DOCS[:2])
    assert {len(v) for v in docs} == {16}
    assert_same(docs, reference["mean16"])
    assert_same([emb.get_query_embedding("cats")], reference["query"])


async def test_an_engine_the_app_runs_on_its_own_loop(tiny_llama_dir, reference):
    async with AsyncLLMEngine.from_config(EngineConfig(model=tiny_llama_dir, **OPTIONS)) as engine:
        emb = AsyncEngineEmbedding(engine=engine)
        assert emb.model_name == tiny_llama_dir
        assert_same(await emb.aget_text_embedding_batch(DOCS), reference["last"])
        stats = engine.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"], "KV blocks leaked"
