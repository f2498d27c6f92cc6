"""The LangChain embeddings (integrations/langchain_embeddings.py) on tiny random-weight Llama and
Qwen3 checkpoints with a tokenizer: sync and async vectors equal ``LLM.embed``'s for the same texts
and the pooled transformers hidden states (fp32, cosine > 0.99999); pooling, dimensions and the
query / document prefixes reach the engine; an engine the app runs is used on its own loop; then
langchain-tests' standard unit and integration suites for embeddings."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # a tiny model on a busy 2-core box

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_tests")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from langchain_tests.integration_tests import EmbeddingsIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import EmbeddingsUnitTests  # noqa: E402

from asyncengine import LLM, AsyncLLMEngine, EngineConfig  # noqa: E402
from asyncengine.integrations.engine_thread import close_shared_engines  # noqa: E402
from asyncengine.integrations.langchain_embeddings import AsyncEngineEmbeddings  # noqa: E402
from model_utils import make_tiny_checkpoint  # noqa: E402

OPTIONS = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 256, "num_threads": 1,
           "freeze_gc_after_load": False}
DOCS = ["a cat sat on the mat", "stock prices fell sharply today", "hello", "the quick brown fox jumps"]
_model_dir: dict[str, str] = {}


@pytest.fixture(autouse=True, scope="module")
def _close_engines():
    """The engines these tests built (shared per model) are shut down with the module."""
    yield
    close_shared_engines()


@pytest.fixture(scope="module")
def tiny_qwen3_tok_dir(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-qwen3-tok")), "qwen3", tokenizer=True)


@pytest.fixture(autouse=True)
def _tiny_dir(tiny_llama_dir):
    _model_dir["llama"] = tiny_llama_dir


def hf_vectors(model_dir: str, texts: list[str], pooling: str = "last", dimensions=None) -> list[torch.Tensor]:
    """transformers' final hidden states of each text (tokenized with special tokens), pooled."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for t in texts:
            h = model(torch.tensor([tok(t)["input_ids"]])).last_hidden_state[0]
            v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling]
            out.append(F.normalize(v[:dimensions] if dimensions else v, dim=-1))
    return out


def assert_same(got: list[list[float]], refs) -> None:
    assert len(got) == len(refs)
    for g, r in zip(got, refs):
        g, r = torch.tensor(g), torch.as_tensor(r)
        assert g.shape == r.shape
        assert F.cosine_similarity(g, r, dim=0).item() > 0.99999


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
async def test_vectors_equal_llm_embed_and_transformers(arch, tiny_llama_dir, tiny_qwen3_tok_dir):
    d = tiny_llama_dir if arch == "llama" else tiny_qwen3_tok_dir
    emb = AsyncEngineEmbeddings(model=d, engine_options=OPTIONS)
    docs, query = emb.embed_documents(DOCS), emb.embed_query(DOCS[1])
    adocs, aquery = await emb.aembed_documents(DOCS), await emb.aembed_query(DOCS[1])
    assert all(isinstance(x, float) for x in query) and len(docs) == len(DOCS)
    with LLM(d, **OPTIONS) as llm:
        ref = llm.embed(DOCS)
    for got in (docs, adocs):
        assert_same(got, ref)
        assert_same(got, hf_vectors(d, DOCS))
    assert_same([query, aquery], [ref[1], ref[1]])
    assert emb.embed_documents([]) == [] and await emb.aembed_documents([]) == []


def test_pooling_dimensions_and_prefixes(tiny_llama_dir):
    emb = AsyncEngineEmbeddings(model=tiny_llama_dir, engine_options=OPTIONS, pooling="mean", dimensions=16,
                                query_prefix="Query: ", document_prefix="Doc: ")
    docs, query = emb.embed_documents(DOCS[:2]), emb.embed_query("cats")
    assert {len(v) for v in docs} == {16}
    assert_same(docs, hf_vectors(tiny_llama_dir, ["Doc: " + t for t in DOCS[:2]], "mean", 16))
    assert_same([query], hf_vectors(tiny_llama_dir, ["Query: cats"], "mean", 16))
    raw = AsyncEngineEmbeddings(model=tiny_llama_dir, engine_options=OPTIONS, pooling="cls", normalize=False)
    v = torch.tensor(raw.embed_query("cats"))
    assert abs(v.norm().item() - 1.0) > 1e-3  # not normalised
    assert_same([v.tolist()], hf_vectors(tiny_llama_dir, ["cats"], "cls"))


def test_bad_options_are_clear_errors(tiny_llama_dir):
    from asyncengine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        AsyncEngineEmbeddings(model=tiny_llama_dir, engine_options=OPTIONS, pooling="max").embed_query("x")
    with pytest.raises(InvalidRequestError, match="dimensions"):
        AsyncEngineEmbeddings(model=tiny_llama_dir, engine_options=OPTIONS, dimensions=4096).embed_query("x")


async def test_an_engine_the_app_runs_on_its_own_loop(tiny_llama_dir):
    async with AsyncLLMEngine.from_config(EngineConfig(model=tiny_llama_dir, **OPTIONS)) as engine:
        emb = AsyncEngineEmbeddings(engine=engine)
        assert emb.model == tiny_llama_dir
        got = await emb.aembed_documents(DOCS[:3])  # on the engine's own loop: no thread hop
        assert_same(got, await engine.embed(DOCS[:3]))
        stats = engine.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"], "KV blocks leaked"


class TestAsyncEngineEmbeddingsUnit(EmbeddingsUnitTests):
    @property
    def embeddings_class(self):
        return AsyncEngineEmbeddings

    @property
    def embedding_model_params(self) -> dict:
        return {"model": _model_dir.get("llama", "tiny"), "engine_options": OPTIONS}

    @property
    def init_from_env_params(self):
        return {"ASYNCENGINE_MODEL": "some/model.gguf"}, {}, {"model": "some/model.gguf"}


class TestAsyncEngineEmbeddingsIntegration(EmbeddingsIntegrationTests):
    @property
    def embeddings_class(self):
        return AsyncEngineEmbeddings

    @property
    def embedding_model_params(self) -> dict:
        return {"model": _model_dir["llama"], "engine_options": OPTIONS}
