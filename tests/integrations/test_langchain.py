"""The LangChain chat model (integrations/langchain.py): langchain-tests' standard unit and
integration suites with every feature we support switched on, over one shared tiny random-weight
engine; then what the suites do not pin: cancellation aborts the engine request (no running
request, no leaked KV block), timeouts, stop sequences, message conversion."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # a tiny model on a busy 2-core box

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_tests")

import asyncio  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from asyncengine.integrations.engine_thread import EngineBridge, close_shared_engines  # noqa: E402
from asyncengine.integrations.langchain import ChatAsyncEngine, shared_engine, to_engine_messages  # noqa: E402

# Standard tests whose assertions need a model that reads the prompt, which no random-weight model
# does: the exact argument asked for (magic_function(3) -> {"input": 3}), a non-empty string
# argument, a joke whose strings end within the token budget, choosing to call a tool unforced, and
# copying Chinese text into an argument. They run on the default model (SmolLM2-135M-Instruct,
# TestChatAsyncEngineOnSmolLM2 below); every other standard test runs on the tiny model, whose
# grammar-constrained calls and JSON are still well-formed (test_forced_tool_call_validates,
# test_structured_output_validates below).
NEEDS_A_READER = {"test_tool_calling", "test_tool_calling_async", "test_bind_runnables_as_tools",
                  "test_structured_output", "test_structured_output_async", "test_structured_output_pydantic_2_v1",
                  "test_json_mode", "test_agent_loop", "test_unicode_tool_call_integration"}


_ON_SMOLLM2 = pytest.mark.xfail(strict=True, reason="needs a model that reads the prompt, which the tiny "
                                                    "random-weight model cannot; runs on SmolLM2 below")


def run_only(cls, names):
    """Leave only the standard tests ``names`` on ``cls`` (an attribute that is not a function is
    not collected). Its suite-compliance check goes too: the tiny-model class runs the whole suite,
    with these tests as xfail overrides, and is the one that check holds for."""
    for name in dir(ChatModelIntegrationTests):
        if name.startswith("test_") and name not in names:
            setattr(cls, name, None)
    return cls


# the tiny model answers in a few tokens; the grammar makes its tool calls and JSON valid
ENGINE_OPTIONS = {"dtype": "float32", "max_model_len": 1024}
MODEL_DEFAULTS = {"max_tokens": 96, "min_tokens": 1}

_model_dir: dict[str, str] = {}


@pytest.fixture(autouse=True, scope="module")
def _close_engines():
    """The engines these tests built (shared per model) are shut down with the module."""
    yield
    close_shared_engines()


@pytest.fixture(scope="session")
def other_tiny_dir(tmp_path_factory) -> str:
    """A second tiny model (other weights, with a tokenizer): the per-call ``model=`` override."""
    from model_utils import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-other")), "llama", seed=1, tokenizer=True)


@pytest.fixture(autouse=True)
def _tiny_dir(tiny_llama_dir, other_tiny_dir):
    _model_dir["llama"] = tiny_llama_dir
    _model_dir["other"] = other_tiny_dir


class TestChatAsyncEngineUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self):
        return ChatAsyncEngine

    @property
    def chat_model_params(self) -> dict:
        return {"model": _model_dir.get("llama", "tiny"), "engine_options": ENGINE_OPTIONS}

    @property
    def init_from_env_params(self):
        return {"ASYNCENGINE_MODEL": "some/model.gguf"}, {}, {"model": "some/model.gguf"}


class OurFeatures:
    """What the chat model supports, for every integration class: JSON mode yes; text only (the
    tiny llama takes no images; a vision model's images: test_chat_images.py)."""

    @property
    def chat_model_class(self):
        return ChatAsyncEngine

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_image_urls(self) -> bool:
        return False


class TestChatAsyncEngineIntegration(OurFeatures, ChatModelIntegrationTests):
    @property
    def chat_model_params(self) -> dict:
        return {"model": _model_dir["llama"], "engine_options": ENGINE_OPTIONS, **MODEL_DEFAULTS}

    @property
    def model_override_value(self) -> str:
        return _model_dir["other"]

    @_ON_SMOLLM2
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_tool_calling(self, model) -> None:
        super().test_tool_calling(model)

    @_ON_SMOLLM2
    async def test_tool_calling_async(self, model) -> None:
        await super().test_tool_calling_async(model)

    @_ON_SMOLLM2
    def test_bind_runnables_as_tools(self, model) -> None:
        super().test_bind_runnables_as_tools(model)

    @_ON_SMOLLM2
    @pytest.mark.parametrize("schema_type", ["pydantic"])
    def test_structured_output(self, model, schema_type) -> None:
        super().test_structured_output(model, schema_type)

    # the suite's other schema types pass here: run them unchanged (the suite wants an override xfail
    # as a whole, so they live under their own name)
    @pytest.mark.parametrize("schema_type", ["typeddict", "json_schema"])
    def test_structured_output_dict_schemas(self, model, schema_type) -> None:
        ChatModelIntegrationTests.test_structured_output(self, model, schema_type)

    @_ON_SMOLLM2
    @pytest.mark.parametrize("schema_type", ["pydantic"])
    async def test_structured_output_async(self, model, schema_type) -> None:
        await super().test_structured_output_async(model, schema_type)

    @pytest.mark.parametrize("schema_type", ["typeddict", "json_schema"])
    async def test_structured_output_async_dict_schemas(self, model, schema_type) -> None:
        await ChatModelIntegrationTests.test_structured_output_async(self, model, schema_type)

    @_ON_SMOLLM2
    def test_structured_output_pydantic_2_v1(self, model) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @_ON_SMOLLM2
    def test_json_mode(self, model) -> None:
        super().test_json_mode(model)

    @_ON_SMOLLM2
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)

    @_ON_SMOLLM2
    def test_unicode_tool_call_integration(self, model, *, tool_choice=None, force_tool_call=True) -> None:
        super().test_unicode_tool_call_integration(model, tool_choice=tool_choice, force_tool_call=force_tool_call)


@pytest.mark.smollm2
@pytest.mark.slow
class TestChatAsyncEngineOnSmolLM2(OurFeatures, ChatModelIntegrationTests):
    """The standard tests that need a model which reads the prompt, on the default model: greedy,
    with a frequency penalty on what it wrote (at 135M parameters it otherwise can loop inside a
    JSON string until the token budget runs out; a repetition penalty would also penalize the
    prompt's "3" that test_tool_calling wants copied)."""

    @property
    def chat_model_params(self) -> dict:
        from asyncengine.models.default_model import ensure_default_model

        return {"model": ensure_default_model(), "engine_options": {"dtype": "float32", "max_model_len": 2048},
                "max_tokens": 256, "temperature": 0.0, "frequency_penalty": 0.5}

    @pytest.mark.xfail(strict=True, reason="SmolLM2-135M answers the weather question in text: it never "
                                           "chooses a tool unforced (tool_choice='auto')")
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)


run_only(TestChatAsyncEngineOnSmolLM2, NEEDS_A_READER)


# ---------------------------------------------------------------- beyond the standard suites

def _engine(model_dir):
    return shared_engine(model_dir, ENGINE_OPTIONS)


async def _settled(engine, timeout: float = 30.0) -> dict:
    """The engine's stats once nothing runs or waits (the abort is applied at the busy loop's next
    turn, on the engine's own loop)."""
    bridge = EngineBridge(engine)

    async def stats(e):
        return e.stats()

    end = time.monotonic() + timeout
    while True:
        s = await bridge.acall(stats)
        if (s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_streams"] == 0) or time.monotonic() > end:
            return s
        await asyncio.sleep(0.02)


def _long(model_dir, **kw) -> ChatAsyncEngine:
    """A chat model whose answers run 600 tokens unless stopped."""
    return ChatAsyncEngine(model=model_dir, engine_options=ENGINE_OPTIONS, max_tokens=600, min_tokens=600, **kw)


async def test_cancelled_astream_aborts_the_engine_request(tiny_llama_dir):
    llm = _long(tiny_llama_dir)
    got = asyncio.Event()
    chunks = []

    async def consume():
        async for c in llm.astream("Hello"):
            chunks.append(c)
            got.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got.wait(), 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    s = await _settled(_engine(tiny_llama_dir))
    assert s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_streams"] == 0
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]  # every block back in the pool
    assert chunks and all(c.chunk_position != "last" for c in chunks)  # it never reached its end


async def test_leaving_astream_early_and_sync_stream_abort_too(tiny_llama_dir):
    llm = _long(tiny_llama_dir)
    agen = llm.astream("Hello")
    await agen.__anext__()
    await agen.aclose()  # break out of an async for
    s = await _settled(_engine(tiny_llama_dir))
    assert s["num_running"] == 0 and s["num_free_kv_blocks"] == s["num_kv_blocks"]

    def sync_part():
        it = llm.stream("Hello")
        next(it)
        it.close()

    before = s["total_output_tokens"]
    await asyncio.to_thread(sync_part)
    s = await _settled(_engine(tiny_llama_dir))
    assert s["num_running"] == 0 and s["num_free_kv_blocks"] == s["num_kv_blocks"]
    assert s["total_output_tokens"] - before < 600  # stopped, not run to its end


async def test_engine_on_the_callers_loop_is_used_directly(tiny_llama_dir):
    """An engine the app runs on its own loop: no thread hop, and cancelling still aborts."""
    from asyncengine import AsyncLLMEngine, EngineConfig

    async with AsyncLLMEngine.from_config(EngineConfig(model=tiny_llama_dir, **ENGINE_OPTIONS)) as engine:
        llm = ChatAsyncEngine(engine=engine, max_tokens=600, min_tokens=600)
        agen = llm.astream("Hello")
        await agen.__anext__()
        assert engine.loop is asyncio.get_running_loop()
        await agen.aclose()
        s = await _settled(engine)
        assert s["num_running"] == 0 and s["num_free_kv_blocks"] == s["num_kv_blocks"]
        short = ChatAsyncEngine(engine=engine, max_tokens=5, min_tokens=5)
        msg = await short.ainvoke("Hello")
        assert msg.usage_metadata["output_tokens"] == 5


def test_timeout_aborts(tiny_llama_dir):
    # 600 tokens take well over 20 ms even at the tiny model's speed with the native decode step
    # (0.3 s was shorter than the whole answer once decoding got faster)
    llm = _long(tiny_llama_dir, timeout=0.02)
    with pytest.raises(TimeoutError):
        llm.invoke("Hello")
    s = asyncio.run(_settled(_engine(tiny_llama_dir)))
    assert s["num_running"] == 0 and s["num_free_kv_blocks"] == s["num_kv_blocks"]


def test_stop_sequence_cuts_the_answer(tiny_llama_dir):
    llm = ChatAsyncEngine(model=tiny_llama_dir, engine_options=ENGINE_OPTIONS, max_tokens=24, min_tokens=24,
                          temperature=0.0)
    full = llm.invoke("Hello").content
    cut = full[len(full) // 2:len(full) // 2 + 3]
    assert cut.strip(), full
    msg = llm.invoke("Hello", stop=[cut])
    assert msg.content == full[:full.index(cut)]
    assert msg.response_metadata["finish_reason"] == "stop" and msg.response_metadata["stop_reason"] == cut


def test_usage_counts_tokens(tiny_llama_dir):
    llm = ChatAsyncEngine(model=tiny_llama_dir, engine_options=ENGINE_OPTIONS, max_tokens=7, min_tokens=7)
    msg = llm.invoke("Hello")
    u = msg.usage_metadata
    assert u["output_tokens"] == 7 and u["input_tokens"] > 0 and u["total_tokens"] == u["input_tokens"] + 7
    streamed = None
    for c in llm.stream("Hello"):
        streamed = c if streamed is None else streamed + c
    assert streamed.usage_metadata == u and streamed.content == msg.content


ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["any", "add"])
def test_forced_tool_call_validates(tiny_llama_dir, choice):
    """Random weights, yet the call is well-formed: the grammar allows nothing else."""
    llm = ChatAsyncEngine(model=tiny_llama_dir, engine_options=ENGINE_OPTIONS, max_tokens=64)
    msg = llm.bind_tools([ADD], tool_choice=choice).invoke("What is 1 + 2?")
    assert msg.content == "" and len(msg.tool_calls) == 1, msg
    call = msg.tool_calls[0]
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"}
    assert all(isinstance(v, int) for v in call["args"].values())
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    streamed = None
    for c in llm.bind_tools([ADD], tool_choice=choice).stream("What is 1 + 2?"):
        streamed = c if streamed is None else streamed + c
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [("add", call["args"])]


def test_structured_output_validates(tiny_llama_dir):
    import jsonschema

    schema = {"title": "city", "type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                                "population": {"type": "integer", "minimum": 0, "maximum": 9999}},
              "required": ["name", "population"], "additionalProperties": False}
    llm = ChatAsyncEngine(model=tiny_llama_dir, engine_options=ENGINE_OPTIONS, max_tokens=96)
    out = llm.with_structured_output(schema).invoke("Name a city.")
    jsonschema.validate(out, schema)
    out = llm.with_structured_output(schema, method="function_calling").invoke("Name a city.")
    jsonschema.validate(out, schema)


def test_bad_tool_choice_is_refused_at_bind(tiny_llama_dir):
    llm = ChatAsyncEngine(model=tiny_llama_dir, engine_options=ENGINE_OPTIONS)
    with pytest.raises(ValueError, match="not among the tools"):
        llm.bind_tools([ADD], tool_choice="subtract")


def test_messages_to_the_engine():
    msgs = to_engine_messages([
        SystemMessage("be brief"), HumanMessage([{"type": "text", "text": "1+2?"}]),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "c1", "type": "tool_call"}]),
        ToolMessage("3", tool_call_id="c1")])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assert json.loads(msgs[2]["content"]) == [{"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert msgs[1]["content"] == "1+2?" and msgs[3]["content"] == "3"
    with pytest.raises(ValueError, match="only text"):
        to_engine_messages([HumanMessage([{"type": "image_url", "image_url": {"url": "x"}}])])
