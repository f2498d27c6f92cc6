"""vLLM's /tokenize and /detokenize: a text's ids as the tokenizer gives them, a conversation's as a
chat request renders it (its prompt_tokens), ids back to text, bad input a 400 naming the field."""
from __future__ import annotations

import httpx
import transformers

from live_server import HANG_GUARD_S, MODEL


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=HANG_GUARD_S)


def test_tokenize_and_detokenize(server, client, tiny_llama_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    text = "Paris is the capital of France."
    r = _post(server, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == tok(text)["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 1024 and r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    bare = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tok(text, add_special_tokens=False)["input_ids"] and bare["token_strs"] is None
    assert _post(server, "/detokenize", {"model": MODEL, "tokens": bare["tokens"]}).json() == {"prompt": text}

    messages = [{"role": "user", "content": "Hello there"}]
    chat = _post(server, "/tokenize", {"messages": messages}).json()
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens
    assert chat["tokens"] == list(tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def test_bad_input_is_400(server):
    for path, body, param in [("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
                              ("/tokenize", {"prompt": "a", "model": "other"}, "model")]:
        r = _post(server, path, body)
        assert r.status_code in (400, 404), (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
