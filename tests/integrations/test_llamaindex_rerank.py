"""The LlamaIndex reranker (integrations/llamaindex_rerank.py) on a tiny random-weight BERT
cross-encoder: sync and async postprocessing return the nodes best first, cut to ``top_n``, each
scored with transformers' sigmoid(logit) (1e-4)."""
from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # a tiny model on a busy 2-core box

pytest.importorskip("llama_index.core")

import torch  # noqa: E402
import transformers  # noqa: E402
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode  # noqa: E402

from asyncengine.integrations.engine_thread import close_shared_engines  # noqa: E402
from asyncengine.integrations.llamaindex_rerank import AsyncEngineRerank  # noqa: E402
from model_utils import make_tiny_bert  # noqa: E402

OPTIONS = {"dtype": "float32", "device": "cpu", "num_threads": 1, "freeze_gc_after_load": False}
QUERY = "the cat sat"
TEXTS = ["the cat sat on the mat", "a dog", "the sky is blue and big", "cat", "far far ran the dog and the cat"]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("li-rerank")
    ref = make_tiny_bert(path, "BertForSequenceClassification", seed=6)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        scores = torch.sigmoid(ref(**tok([QUERY] * len(TEXTS), TEXTS, padding=True,
                                          return_tensors="pt")).logits[:, 0]).tolist()
    yield str(path), scores
    close_shared_engines()


def test_postprocess_nodes_sync_and_async(cross_encoder):
    path, scores = cross_encoder
    nodes = [NodeWithScore(node=TextNode(text=t, id_=f"n{i}"), score=0.0) for i, t in enumerate(TEXTS)]
    rr = AsyncEngineRerank(model=path, engine_options=OPTIONS, top_n=3)
    best = sorted(range(len(TEXTS)), key=lambda i: -scores[i])[:3]
    for out in (rr.postprocess_nodes(nodes, query_str=QUERY),
                asyncio.run(rr.apostprocess_nodes(nodes, query_bundle=QueryBundle(QUERY)))):
        assert [n.node.node_id for n in out] == [f"n{i}" for i in best]
        for n, i in zip(out, best):
            assert abs(n.score - scores[i]) < 1e-4
    with pytest.raises(ValueError, match="query"):
        rr.postprocess_nodes(nodes)
