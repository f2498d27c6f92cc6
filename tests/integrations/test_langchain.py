"""The LangChain chat model (integrations/langchain.py): langchain-tests' standard unit and
integration suites with every feature we support switched on, over one shared tiny random-weight
engine; then what the suites do not pin: cancellation aborts the engine request (no running
request, no leaked KV block), timeouts, stop sequences, message conversion."""
from __future__ import annotations

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_tests")

from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from asyncengine.integrations.langchain import ChatAsyncEngine  # noqa: E402

# the tiny model answers in a few tokens; the grammar makes its tool calls and JSON valid
ENGINE_OPTIONS = {"dtype": "float32", "max_model_len": 1024}
MODEL_DEFAULTS = {"max_tokens": 96, "min_tokens": 1}

_model_dir: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _tiny_dir(tiny_llama_dir):
    _model_dir["llama"] = tiny_llama_dir


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


class TestChatAsyncEngineIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self):
        return ChatAsyncEngine

    @property
    def chat_model_params(self) -> dict:
        return {"model": _model_dir["llama"], "engine_options": ENGINE_OPTIONS, **MODEL_DEFAULTS}

    @property
    def supports_json_mode(self) -> bool:
        return True

    # text only: the engine has no image, audio or file inputs
    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_image_urls(self) -> bool:
        return False
