"""The official ``openai`` client, unmodified, against the live server: completions and chat,
streaming or not, n > 1, logprobs, usage, stop strings, and every error status surfacing as the
client's own exception type. Greedy (temperature 0) wherever text is compared; ``ignore_eos`` (a
vLLM extra, sent with extra_body) wherever token counts are."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncengine import SamplingParams
from asyncengine.engine.llm import render_chat
from live_server import API_KEY, HANG_GUARD_S, MODEL
from model_utils import model_hook

NO_EOS = {"ignore_eos": True}
NO_SPECIALS = {"0": -100, "1": -100, "2": -100}  # <s> </s> <pad> of the tiny tokenizer
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fox."}]


def engine_text(server, prompt, **params) -> str:
    """What the engine itself generates for this prompt (run on the server's loop)."""
    out = server.run(server.engine.complete(prompt, SamplingParams(**params)))
    return out.outputs[0].text


# ---------------------------------------------------------------- happy paths


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    r = httpx.get(server.base_url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_completion_text_usage_and_params_pass_through(server, client):
    prompt = "The quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0, extra_body=NO_EOS)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    [choice] = r.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    n_prompt = len(server.engine.tokenizer.encode(prompt))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 7, n_prompt + 7)
    # the server hands the prompt and the parameters to the engine unchanged
    assert choice.text == engine_text(server, prompt, max_tokens=7, temperature=0, ignore_eos=True)
    # a token-id prompt is the same prompt
    ids = server.engine.tokenizer.encode(prompt)
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=7, temperature=0, extra_body=NO_EOS)
    assert r2.choices[0].text == choice.text and r2.usage.prompt_tokens == n_prompt


def test_completion_stream_equals_non_stream(client):
    kw = dict(model=MODEL, prompt="def f(x):", max_tokens=12, temperature=0, extra_body=NO_EOS)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.id == chunks[0].id for c in chunks)


def test_chat_stream_equals_non_stream_and_usage(server, client):
    kw = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=10, temperature=0, extra_body=NO_EOS)
    full = client.chat.completions.create(**kw)
    assert full.object == "chat.completion"
    msg = full.choices[0].message
    assert msg.role == "assistant" and full.choices[0].finish_reason == "length"
    n_prompt = len(render_chat(server.engine.tokenizer, MESSAGES))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (n_prompt, 10)
    assert msg.content == engine_text(server, MESSAGES, max_tokens=10, temperature=0, ignore_eos=True)

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == n_prompt
    # max_tokens (the older name) means the same
    old = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                         extra_body=NO_EOS)
    assert old.choices[0].message.content == msg.content


def test_n_samples_seeded_and_merged(client):
    kw = dict(model=MODEL, prompt="Paris is", max_tokens=6, temperature=1.0, seed=7, extra_body=NO_EOS)
    r = client.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens == client.completions.create(
        n=1, **kw).usage.prompt_tokens  # the prompt is counted once
    # sample i is the request seeded seed + i: reproducible, and not n copies of one sample
    singles = [client.completions.create(**{**kw, "seed": 7 + i}).choices[0].text for i in range(3)]
    assert [c.text for c in r.choices] == singles
    assert len(set(singles)) > 1
    # several prompts x n: choice index = prompt index * n + sample
    b = client.completions.create(model=MODEL, prompt=["Paris is", "The quick"], n=2, max_tokens=3,
                                  temperature=1.0, seed=7, extra_body=NO_EOS)
    assert [c.index for c in b.choices] == [0, 1, 2, 3] and b.usage.completion_tokens == 12
    per_prompt = [client.completions.create(model=MODEL, prompt=p, max_tokens=1, extra_body=NO_EOS)
                  .usage.prompt_tokens for p in ("Paris is", "The quick")]
    assert b.usage.prompt_tokens == sum(per_prompt)

    # chat, streamed: both choices arrive, interleaved in one SSE stream, each finished once
    texts, finishes = {0: "", 1: ""}, {}
    for c in client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=8, seed=3,
                                            stream=True, extra_body=NO_EOS):
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                assert ch.index not in finishes
                finishes[ch.index] = ch.finish_reason
    assert finishes == {0: "length", 1: "length"}
    nonstream = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=8, seed=3,
                                               extra_body=NO_EOS)
    assert [c.message.content for c in nonstream.choices] == [texts[0], texts[1]]


def test_echo(server, client):
    r = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=4, temperature=0, echo=True,
                                  extra_body=NO_EOS)
    plain = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=4, temperature=0,
                                      extra_body=NO_EOS)
    assert r.choices[0].text == "Echo me" + plain.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="Echo me", max_tokens=4, temperature=0, echo=True,
                                            stream=True, extra_body=NO_EOS))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The lazy dog", max_tokens=6, temperature=0, logprobs=3,
                                  extra_body=NO_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0.0
        assert 1 <= len(top) <= 4 and top.get(tok) == val  # the sampled token is always there
        assert val >= max(top.values()) - 1e-4  # greedy: the sampled token is the most likely
    assert lp.text_offset == sorted(lp.text_offset)
    # streamed: the same logprobs, spread over the chunks
    chunks = list(client.completions.create(model=MODEL, prompt="The lazy dog", max_tokens=6, temperature=0,
                                            logprobs=3, stream=True, extra_body=NO_EOS))
    streamed = [t for c in chunks for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs)


def test_chat_logprobs(client):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
              logit_bias=NO_SPECIALS, extra_body=NO_EOS)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy
    # ``bytes`` are the tokens' raw bytes: joined, they are the answer (even across split characters)
    joined = b"".join(bytes(item.bytes) for item in content).decode("utf-8", errors="replace")
    assert joined == r.choices[0].message.content
    streamed = [i.logprob for c in client.chat.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs for i in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([i.logprob for i in content])
    # logprobs without top_logprobs: the sampled token only
    r0 = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True)
    assert all(i.top_logprobs == [] for i in r0.choices[0].logprobs.content)


def test_stop_string_and_penalties(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0, logit_bias=NO_SPECIALS,
              extra_body=NO_EOS)
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = full.find(stop)
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra.get("stop_reason") == stop
    # penalties are accepted and change greedy text that repeats tokens
    pen = client.completions.create(presence_penalty=2.0, frequency_penalty=2.0, **kw)
    assert pen.choices[0].finish_reason == "length" and pen.usage.completion_tokens == 24


# ---------------------------------------------------------------- errors


def _error_body(server, path: str, body) -> tuple[int, dict]:
    r = httpx.post(server.base_url + path, content=body if isinstance(body, bytes) else None,
                   json=None if isinstance(body, bytes) else body, timeout=HANG_GUARD_S,
                   headers={"content-type": "application/json"})
    return r.status_code, r.json()


def test_bad_requests_are_400_in_openai_shape(server, client):
    cases = [
        (dict(prompt="hi", temperature=3.0), "temperature"),
        (dict(prompt="hi", n=0), "n"),
        (dict(prompt="hi", max_tokens=0), "max_tokens"),
        (dict(prompt="hi", logprobs=21), "logprobs"),
        (dict(prompt="hi", max_tokens=2000), "max_tokens"),  # prompt + max_tokens > 1024
        (dict(prompt=""), "prompt"),
        (dict(prompt=[]), "prompt"),
        (dict(prompt=[5, 99999]), "prompt"),  # outside the vocabulary
        (dict(prompt=[1.5]), "prompt"),
        (dict(prompt="hi", stop=[""]), None),
        (dict(prompt="hi", logit_bias={"x": 1}), "logit_bias"),
        (dict(prompt="hi", stream_options={"include_usage": True}), "stream_options"),
    ]
    for body, param in cases:
        status, err = _error_body(server, "/v1/completions", {"model": MODEL, **body})
        assert status == 400, (body, err)
        assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, err
        assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
        if param is not None:
            assert err["error"]["param"] == param, (body, err)
    status, err = _error_body(server, "/v1/completions", {"model": MODEL, "prompt": "x" * 5000, "max_tokens": 1})
    assert status == 400 and err["error"]["code"] == "context_length_exceeded"
    status, err = _error_body(server, "/v1/chat/completions",
                              {"model": MODEL, "messages": [{"role": "user", "content": "x " * 3000}]})
    assert status == 400 and err["error"]["code"] == "context_length_exceeded"
    assert "your messages resulted in" in err["error"]["message"]  # grammar (was "your messages has")
    for raw in (b"", b"{not json", b"[1, 2]", b'{"model": "tiny-llama"}'):
        status, err = _error_body(server, "/v1/chat/completions", raw)
        assert status == 400 and err["error"]["type"] == "invalid_request_error", (raw, err)
    for body in ({"messages": []}, {"messages": [{"role": "wizard", "content": "hi"}]},
                 {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                 {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}):
        status, err = _error_body(server, "/v1/chat/completions", {"model": MODEL, **body})
        assert status == 400, (body, err)

    # through the client: its own exception types, carrying our error body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5000)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    assert e.value.param == "max_tokens" and "maximum context length is 1024" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", top_p=1.5)


def test_unknown_model_and_route_are_404(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    r = httpx.get(server.base_url + "/v1/no/such/route")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(server.base_url + "/v1/completions")  # wrong method
    assert r.status_code == 405 and "error" in r.json()


def test_api_key(strict_server, strict_client):
    assert [m.id for m in strict_client.models.list().data] == [MODEL]
    r = strict_client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens >= 1
    for key in ("wrong-key", "sk-test-ke", "sk-test-key-and-more"):
        with openai.OpenAI(base_url=strict_server.base_url + "/v1", api_key=key, max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError) as e:
                bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
    assert httpx.post(strict_server.base_url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
    # only /health stays open for probes (the metrics count requests and tokens: key needed)
    assert httpx.get(strict_server.base_url + "/health").status_code == 200
    assert httpx.get(strict_server.base_url + "/metrics").status_code == 401
    assert httpx.get(strict_server.base_url + "/openapi.json").status_code == 401
    assert httpx.get(strict_server.base_url + "/metrics", headers={"authorization": f"Bearer {API_KEY}"}
                     ).status_code == 200


def test_overloaded_is_429_and_all_or_nothing(strict_server, strict_client):
    # max_queued_requests=1: two prompts need two waiting slots: refused at once, whole
    with pytest.raises(openai.RateLimitError) as e:
        strict_client.completions.create(model=MODEL, prompt=["hi", "ho"], max_tokens=4)
    assert e.value.status_code == 429 and e.value.response.headers.get("retry-after") == "1"
    # n=2 can never fit in a queue of 1: a bad request (400 naming the limit), not "retry later"
    with pytest.raises(openai.BadRequestError) as e:
        strict_client.completions.create(model=MODEL, prompt="hi", n=2, max_tokens=4)
    assert "max_queued_requests=1" in e.value.message and e.value.code == "limit_exceeded"
    strict_server.wait_clean("the refused request's first sample to be aborted")
    assert strict_client.completions.create(model=MODEL, prompt="hi", max_tokens=4).choices


def test_shutting_down_is_503(make_server):
    srv = make_server()
    with openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=HANG_GUARD_S) as c:
        stream = c.completions.create(model=MODEL, prompt="hi", max_tokens=900, stream=True, extra_body=NO_EOS)
        next(iter(stream))  # one request in flight, so a draining shutdown has to wait for it
        done = srv.run(srv.engine.shutdown(drain=True), wait=False)
        for _ in range(int(HANG_GUARD_S / 0.01)):
            if httpx.get(srv.base_url + "/health").status_code == 503:
                break
            time.sleep(0.01)
        else:
            raise AssertionError("/health never said 503 while the engine drained")
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert e.value.status_code == 503 and e.value.code == "shutting_down"
        stream.close()  # the client leaves: its request is aborted and the drain can end
        done.result(HANG_GUARD_S)


def test_dead_engine_is_503_never_500(make_server):
    """A dead engine: 503 everywhere (a supervisor restarts the server: issue 27), the fault's first
    line in the message, never a traceback."""
    srv = make_server()

    def boom(k):
        raise RuntimeError("simulated model fault")

    with model_hook(srv.engine, boom), \
            openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=HANG_GUARD_S) as c:
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert e.value.status_code == 503 and e.value.code == "engine_dead"
        assert "simulated model fault" in e.value.message and "Traceback" not in e.value.message
        with pytest.raises(openai.InternalServerError) as e:  # and every later request
            c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert e.value.status_code == 503
    assert httpx.get(srv.base_url + "/health").status_code == 503  # a model fault: the server cannot serve any more


# ---------------------------------------------------------------- client disconnects


@pytest.mark.parametrize("n", [1, 2])
def test_stream_disconnect_aborts_and_frees_blocks(server, client, n):
    server.wait_clean()
    before = server.stats()["total_output_tokens"]
    with client.completions.create(model=MODEL, prompt="Tell me a long story", max_tokens=900, stream=True, n=n,
                                   extra_body=NO_EOS) as stream:
        next(iter(stream))
        assert server.stats()["num_running"] == n
    server.wait_clean("the abandoned stream's requests to be aborted")
    assert server.on_loop(lambda: server.engine.core.kv.num_free_blocks) == server.engine.core.num_blocks
    assert server.stats()["total_output_tokens"] - before < n * 900  # they did not run to the end


def _finished_aborts(server) -> float:
    """asyncengine_requests_finished_total{finish_reason="abort"}, scraped from /metrics."""
    for fam in text_string_to_metric_families(httpx.get(server.base_url + "/metrics").text):
        if fam.name == "asyncengine_requests_finished":
            return sum(s.value for s in fam.samples
                       if s.name.endswith("_total") and s.labels.get("finish_reason") == "abort")
    return 0.0


def _wait_for(cond, what: str) -> None:
    for _ in range(int(HANG_GUARD_S / 0.01)):
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_non_stream_disconnect_aborts(server):
    """A client that leaves a non-streaming request gets it aborted. The model is held still (a
    blocking hook on its forward) from the request's first step until the server has counted the
    abort, so the request cannot finish first, however fast the machine."""
    server.wait_clean()
    before = server.stats()["total_output_tokens"]
    aborts = _finished_aborts(server)
    gate = threading.Event()
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 900, "ignore_eos": True}).encode()
    with model_hook(server.engine, lambda k: gate.wait(HANG_GUARD_S)):
        try:
            with socket.create_connection(("127.0.0.1", server.port), timeout=HANG_GUARD_S) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                             b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
                _wait_for(lambda: server.stats()["num_running"] == 1, "the request to be scheduled")
            _wait_for(lambda: _finished_aborts(server) == aborts + 1, "the server to abort the request")
        finally:
            gate.set()
    server.wait_clean("the abandoned request to be aborted")
    assert server.stats()["total_output_tokens"] - before < 900
