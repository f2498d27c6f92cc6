"""Multi-LoRA over the OpenAI server (integrations/openai_server/lora_routes.py), with the official
openai client against a live server on 127.0.0.1: ``model`` names an adapter (``--lora-modules`` at
start, or ``/v1/load_lora_adapter`` later) and the tokens equal ``LLM.generate`` under the same
adapter; /v1/models lists the adapters; unloading makes the name a 404; a bad adapter is a 400
and changes nothing; the websocket chat
resolves ``model`` as the chat endpoint does."""
import asyncio
import json
import sys
from pathlib import Path

import httpx
import openai
import pytest

from asyncengine import LLM, LoRARequest, SamplingParams
from conftest import openai_client
from live_server import MODEL, LiveServer, make_engine

sys.path.insert(0, str(Path(__file__).parents[1] / "lora"))  # tests/lora: the tiny PEFT adapters
from lora_utils import make_adapter  # noqa: E402

PROMPTS = [[5, 17, 99, 230, 41, 8, 77], [300, 12, 6, 450, 3, 3, 91, 20, 14]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def setup(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("server-loras")
    adapters = {n: make_adapter(tiny_llama_dir, str(root / n), n, seed=k) for k, n in enumerate(("a4", "a8"))}
    s = LiveServer(make_engine(tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16),
                   own_engine=True, lora_modules=[("sql", adapters["a4"])]).start()
    yield s, adapters
    s.stop()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60.0)


def _complete(client, model: str) -> list[list[int]]:
    """The greedy completions of PROMPTS under ``model``."""
    outs = []
    for p in PROMPTS:
        r = client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0.0,
                                      extra_body={"ignore_eos": True})
        assert r.model == model
        outs.append(r.choices[0].text)
    return outs


@pytest.fixture(scope="module")
def reference(setup, tiny_llama_dir) -> dict[str, list[str]]:
    """``LLM.generate`` of PROMPTS under each adapter (and none): what the server must answer."""
    _, adapters = setup
    llm = LLM(tiny_llama_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = {}
    for m, lr in (("sql", LoRARequest("sql", 1, adapters["a4"])), ("chat", LoRARequest("chat", 2, adapters["a8"])),
                  (None, None)):
        want[m] = [o.outputs[0].text for o in llm.generate([list(p) for p in PROMPTS], sp, use_tqdm=False,
                                                           lora_request=lr)]
    return want


def test_completions_through_two_adapters_equal_llm_generate(setup, reference):
    server, adapters = setup
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": adapters["a8"]}).status_code == 200
    client = openai_client(server)
    got = {m: _complete(client, m) for m in ("sql", "chat", MODEL)}
    assert got == {"sql": reference["sql"], "chat": reference["chat"], MODEL: reference[None]}
    assert got["sql"] != got[MODEL] and got["chat"] != got[MODEL] and got["sql"] != got["chat"]
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "chat"}).status_code == 200


def test_models_lists_the_adapters_with_their_parent(setup):
    server, adapters = setup
    client = openai_client(server)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, "sql"}
    assert cards["sql"].parent == MODEL and cards["sql"].root == adapters["a4"]
    assert client.models.retrieve("sql").id == "sql"
    spec = httpx.get(server.base_url + "/openapi.json").json()["components"]["schemas"]
    assert spec["CompletionRequest"]["properties"]["model"]["enum"] == [MODEL, "sql"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_load_use_unload_then_404(setup):
    server, adapters = setup
    client = openai_client(server)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="late", prompt=PROMPTS[0], max_tokens=2)
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["a8"]})
    assert r.status_code == 200, r.text
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["a4"]}).status_code == 400
    out = client.completions.create(model="late", prompt=PROMPTS[0], max_tokens=2, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="late", prompt=PROMPTS[0], max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    server.wait_clean("the adapters' requests to finish")


def test_bad_adapters_are_400_and_change_nothing(setup, tmp_path, tiny_model_dir):
    server, adapters = setup
    client = openai_client(server)
    before = [m.id for m in client.models.list().data]
    other = make_adapter(tiny_model_dir("llama", num_key_value_heads=4), str(tmp_path / "other"), "a4")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    (broken / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    bad_header = tmp_path / "bad_header"
    bad_header.mkdir()
    (bad_header / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (bad_header / "adapter_model.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    cases = {str(tmp_path / "none"): "no such folder", other: "another base model", str(broken): "not valid JSON",
             str(bad_header): "unreadable", "/etc": "no adapter_config.json"}
    for k, (path, why) in enumerate(cases.items()):
        r = _post(server, "/v1/load_lora_adapter", {"lora_name": f"bad{k}", "lora_path": path})
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    for body in ({"lora_name": "x"}, {"lora_name": MODEL, "lora_path": adapters["a4"]}, {"lora_path": "/x"}):
        assert _post(server, "/v1/load_lora_adapter", body).status_code == 400
    assert [m.id for m in client.models.list().data] == before
    out = client.completions.create(model="sql", prompt=PROMPTS[0], max_tokens=2, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2


def test_endpoints_absent_without_enable_lora(server):
    """A server without enable_lora has no load endpoint, and an adapter's name is an unknown model."""
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        openai_client(server).completions.create(model="a", prompt=[5, 6], max_tokens=1)


def test_langchain_and_llamaindex_take_an_adapter(setup):
    """The adapters (integrations/langchain.py, llamaindex.py) run under a LoRARequest or an adapter
    registered on the engine, as the server's ``model`` does: the same greedy text."""
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from asyncengine.integrations.langchain import ChatAsyncEngine
    from asyncengine.integrations.llamaindex import AsyncEngineLLM

    server, adapters = setup
    client = openai_client(server)
    text, five = "hello there", {"temperature": 0.0, "max_tokens": 5}
    chat = {m: client.chat.completions.create(model=m, messages=[{"role": "user", "content": text}], **five,
                                              extra_body={"min_tokens": 5}).choices[0].message.content
            for m in ("sql", MODEL)}
    done = {m: client.completions.create(model=m, prompt=text, **five).choices[0].text for m in ("sql", MODEL)}
    assert chat["sql"] != chat[MODEL] and done["sql"] != done[MODEL]
    lc = ChatAsyncEngine(engine=server.engine, min_tokens=5, lora_request="sql", **five)
    assert lc.invoke(text).content == chat["sql"]
    assert ChatAsyncEngine(engine=server.engine, min_tokens=5, **five).invoke(text).content == chat[MODEL]
    by_request = LoRARequest("sql-again", 77, adapters["a4"])
    assert ChatAsyncEngine(engine=server.engine, min_tokens=5, **five).invoke(
        text, lora_request=by_request).content == chat["sql"]
    li = AsyncEngineLLM(engine=server.engine, lora_request="sql", **five)
    assert li.complete(text).text == done["sql"]
    assert AsyncEngineLLM(engine=server.engine, **five).complete(text).text == done[MODEL]
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
        AsyncEngineLLM(engine=server.engine, lora_request="nope", **five).complete(text)


def test_serve_lora_modules_flag(setup, reference, tiny_llama_dir, tmp_path):
    """``asyncengine serve --enable-lora --lora-modules sql=... chat=...`` as a user runs it."""
    from test_cli_serve import running_serve

    _, adapters = setup
    with running_serve(tiny_llama_dir, tmp_path, "--dtype", "float32", "--max-model-len", "256", "--enable-lora",
                       "--max-loras", "2", "--lora-modules", f"sql={adapters['a4']}", f"chat={adapters['a8']}") as (_, base):
        with openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60.0) as c:
            assert {m.id: getattr(m, "parent", None) for m in c.models.list().data} == \
                {tiny_llama_dir: None, "sql": tiny_llama_dir, "chat": tiny_llama_dir}
            assert {m: _complete(c, m) for m in ("sql", "chat")} == {m: reference[m] for m in ("sql", "chat")}


def test_pd_front_end_serves_adapters(setup, reference, tiny_llama_dir, tmp_path):
    """The P/D front end (a prefill and a decode core, each a process) keeps the same registry and
    runs the adapter on both sides: the same tokens as LLM.generate, every prompt through the hop."""
    from asyncengine import EngineConfig
    from asyncengine.engine.async_engine import AsyncLLMEngine

    _, adapters = setup
    pd = AsyncLLMEngine.from_config(EngineConfig(
        model=tiny_llama_dir, dtype="float32", prefill_cores=1, decode_cores=1, pd_skip_hop_below=0,
        kv_transfer_dir=str(tmp_path / "pd"), num_kv_blocks=64, max_model_len=256, enable_lora=True, max_loras=2))
    s = LiveServer(pd, own_engine=True, lora_modules=[("sql", adapters["a4"])]).start()
    try:
        client = openai_client(s)
        assert _complete(client, "sql") == reference["sql"]
        assert _post(s, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": adapters["a8"]}).status_code == 200
        assert _complete(client, "chat") == reference["chat"]
        assert _post(s, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}).status_code == 400
        [decode] = s.stats()["decode"]
        assert decode["kv_transfer_imported_requests"] >= 4
    finally:
        s.stop()


def test_responses_and_messages_run_the_adapter_as_chat_does(setup):
    """The endpoints built on one chat turn (chat_turn.py) resolve ``model`` as chat does."""
    server, _ = setup
    client = openai_client(server)
    msgs, five = [{"role": "user", "content": "hello there"}], {"temperature": 0.0}
    chat = {m: client.chat.completions.create(model=m, messages=msgs, max_tokens=5, **five).choices[0].message.content
            for m in ("sql", MODEL)}
    assert chat["sql"] != chat[MODEL]
    r = client.responses.create(model="sql", input=msgs, max_output_tokens=5, **five)
    assert (r.model, r.output_text) == ("sql", chat["sql"])
    m = _post(server, "/v1/messages", {"model": "sql", "messages": msgs, "max_tokens": 5, **five}).json()
    assert (m["model"], "".join(b["text"] for b in m["content"] if b["type"] == "text")) == ("sql", chat["sql"])
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input=msgs, max_output_tokens=5)
    assert asyncio.run(_ws_chat(server, "sql", msgs, 5)) == chat["sql"]  # the websocket chat too


async def _ws_chat(server, model: str, messages: list, max_tokens: int) -> str:
    """The text of one websocket chat turn (``/v1/ws/chat``) under ``model``."""
    import websockets  # lazy: only this test speaks the websocket protocol

    async with websockets.connect(server.ws_url) as ws:
        await ws.send(json.dumps({"type": "chat", "id": "w", "model": model, "messages": messages,
                                  "max_tokens": max_tokens, "temperature": 0.0}))
        text = ""
        while True:
            f = json.loads(await asyncio.wait_for(ws.recv(), 120))
            assert f["type"] in ("delta", "done"), f
            if f["type"] == "done":
                return text
            text += f["text"]
