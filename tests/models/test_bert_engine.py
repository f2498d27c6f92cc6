"""BERT encoders through the engine (models/bert_engine.py, models/pooling_models.py): rerank scores
of a cross-encoder through the scheduler, a batch of pairs of mixed lengths, equal (1e-4) to
sentence-transformers' CrossEncoder.predict and to transformers' sigmoid(logit); a
sentence-transformers BertModel's embeddings (its modules.json pooling by default) within cosine
0.99999 of SentenceTransformer.encode; no KV block held after; the wrong task refused clearly."""
from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F
import transformers

from asyncengine import LLM, AsyncLLMEngine, EngineConfig, SamplingParams
from asyncengine.errors import ConfigError, InvalidRequestError
from model_utils import make_tiny_bert, write_st_pooling

COMMON = dict(dtype="float32", device="cpu", num_threads=1, freeze_gc_after_load=False, seed=0)
QUERY = "the cat sat"
DOCS = ["the cat sat on the mat", "a dog", "the sky is blue and big", "cat", "far far ran the dog and the cat",
        "is", "blue sky and big mat on the far dog"]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert-cross-encoder")
    return path, make_tiny_bert(path, "BertForSequenceClassification", seed=3)


def hf_scores(ref, path, queries, docs) -> torch.Tensor:
    tok = transformers.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return torch.sigmoid(ref(**tok(queries, docs, padding=True, return_tensors="pt")).logits[:, 0])


@pytest.mark.usefixtures("one_torch_thread")
def test_llm_rerank_equals_cross_encoder_predict(cross_encoder):
    st = pytest.importorskip("sentence_transformers")
    path, ref = cross_encoder
    want = torch.as_tensor(st.CrossEncoder(str(path), device="cpu").predict([(QUERY, d) for d in DOCS]))
    queries = ["a dog", "big sky", "the cat", "far", "mat", "is it", "dog"]
    # a budget of a few prompts: several steps, each a batch of whole prompts of mixed lengths
    with LLM(str(path), max_num_batched_tokens=24, **COMMON) as llm:
        assert llm.supported_tasks == ("classify", "embed")
        got = torch.tensor(llm.rerank(QUERY, DOCS))
        pairwise = torch.tensor(llm.rerank(queries, DOCS))
        assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks and not llm.engine.kv.req_to_blocks
        assert not llm.engine.config.enable_chunked_prefill and not llm.engine.config.enable_prefix_caching
        with pytest.raises(InvalidRequestError, match="cannot generate"):
            llm.generate([[2, 5, 6]], SamplingParams(max_tokens=4))
        with pytest.raises(InvalidRequestError, match="at least one document"):
            llm.rerank(QUERY, [])
        with pytest.raises(InvalidRequestError, match="at most 63"):
            llm.rerank(QUERY, [" ".join(["cat"] * 70)])
        with pytest.raises(InvalidRequestError, match="one per document"):
            llm.rerank(["a", "b"], DOCS)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    torch.testing.assert_close(got, hf_scores(ref, path, [QUERY] * len(DOCS), DOCS), rtol=0, atol=1e-4)
    torch.testing.assert_close(pairwise, hf_scores(ref, path, queries, DOCS), rtol=0, atol=1e-4)


@pytest.mark.usefixtures("one_torch_thread")
def test_async_engine_reranks_concurrent_batches(cross_encoder):
    """Three rerank calls at once through AsyncLLMEngine: their pairs share the scheduler's steps."""
    path, ref = cross_encoder
    calls = [(QUERY, DOCS), ("a dog ran", DOCS[:3]), ("blue", DOCS[2:])]

    async def run():
        async with AsyncLLMEngine.from_config(EngineConfig(model=str(path), **COMMON)) as eng:
            assert eng.default_pooling == "cls"
            out = await asyncio.wait_for(asyncio.gather(*(eng.rerank(q, d) for q, d in calls)), 120)
            with pytest.raises(InvalidRequestError, match="cannot generate"):
                await eng.complete([2, 5, 6], SamplingParams(max_tokens=2))
            return out, eng.stats()

    outs, stats = asyncio.run(run())
    for (q, d), got in zip(calls, outs):
        torch.testing.assert_close(torch.tensor(got), hf_scores(ref, path, [q] * len(d), d), rtol=0, atol=1e-4)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


@pytest.mark.usefixtures("one_torch_thread")
def test_rerank_through_a_core_process(cross_encoder):
    """The encoder's scheduling is set in the core, wherever it runs: here its own process."""
    path, ref = cross_encoder

    async def run():
        async with AsyncLLMEngine.from_config(EngineConfig(model=str(path), engine_core_process=True, **COMMON)) as eng:
            return await asyncio.wait_for(eng.rerank(QUERY, DOCS), 180)

    got = torch.tensor(asyncio.run(run()))
    torch.testing.assert_close(got, hf_scores(ref, path, [QUERY] * len(DOCS), DOCS), rtol=0, atol=1e-4)


@pytest.mark.usefixtures("one_torch_thread")
def test_llm_embed_on_a_sentence_transformers_bert(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    make_tiny_bert(tmp_path, seed=4)
    write_st_pooling(tmp_path, "mean", normalize=True)
    want = torch.as_tensor(st.SentenceTransformer(str(tmp_path), device="cpu").encode(DOCS))
    with LLM(str(tmp_path), max_num_batched_tokens=32, **COMMON) as llm:
        assert llm.default_pooling == "mean" and llm.supported_tasks == ("embed",)
        got = torch.tensor(llm.embed(DOCS))
        with pytest.raises(InvalidRequestError, match="cannot rerank"):
            llm.rerank(QUERY, DOCS)
    assert F.cosine_similarity(got, want, dim=-1).min().item() > 0.99999


def test_wrong_runner_or_task_is_refused(cross_encoder, tiny_llama_dir):
    path, _ = cross_encoder
    with pytest.raises(ConfigError, match="runner"):
        EngineConfig(model=str(path), runner="encode")
    with pytest.raises(ConfigError, match="cannot generate"):
        LLM(str(path), runner="generate", **COMMON)
    with LLM(tiny_llama_dir, max_model_len=64, num_kv_blocks=32, **COMMON) as llm:
        assert llm.supported_tasks == ("generate", "embed")
        with pytest.raises(InvalidRequestError, match="cannot rerank"):
            llm.rerank("a", ["b"])
    with LLM(tiny_llama_dir, runner="pooling", max_model_len=64, num_kv_blocks=32, **COMMON) as llm:
        with pytest.raises(InvalidRequestError, match="cannot generate"):
            llm.generate([[5, 6]], SamplingParams(max_tokens=2))
        assert len(llm.embed([[5, 6, 7]])[0]) == 64


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("arch", ["RobertaForSequenceClassification", "XLMRobertaModel"])
def test_roberta_family_through_the_engine(tmp_path, arch):
    """RoBERTa / XLM-R: positions after pad_token_id (so 2 fewer tokens fit), the classification
    head's own names; token ids in, vs transformers (logits 1e-4, mean-pooled hidden states)."""
    from asyncengine.engine.pooling import pooling_params
    from asyncengine.pooling_params import PoolingSpec

    cls = getattr(transformers, arch)
    cfg = cls.config_class(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, max_position_embeddings=40, pad_token_id=1, num_labels=1,
                           type_vocab_size=1, architectures=[arch])
    torch.manual_seed(0)
    ref = cls(cfg).eval()
    ref.save_pretrained(tmp_path)
    prompts = [[0] + [5 + (i * 7 + j) % 50 for j in range(n)] + [2] for i, n in enumerate((3, 20, 1, 35, 9))]
    classify = arch.endswith("Classification")
    spec = PoolingSpec("cls", False, task="classify") if classify else PoolingSpec("mean", False)
    with LLM(str(tmp_path), skip_tokenizer_init=True, **COMMON) as llm:
        assert llm.engine.max_model_len == 38
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], pooling_params(spec))
        with pytest.raises(InvalidRequestError):
            llm.generate([{"prompt_token_ids": [5] * 38}], pooling_params(spec))
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            r = ref(torch.tensor([p]))
            want = r.logits[0] if classify else r.last_hidden_state[0].mean(0)
            torch.testing.assert_close(torch.tensor(o.embedding), want, rtol=0, atol=1e-4)
