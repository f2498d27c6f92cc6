"""The web chat page (examples/web_chat/, served at /) end to end in headless Chromium: type a
message, watch the answer stream in over the websocket, stop a long one. Uses Debian's chromium
(CI installs it with apt), never a downloaded browser."""
from __future__ import annotations

import contextlib
import os
import time

import pytest

from live_server import MODEL

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 60_000

# counts the updates of the newest answer bubble (streamed = many, not one at the end)
WATCH = """() => {
  window.__updates = 0;
  new MutationObserver(() => {
    const all = document.querySelectorAll('.msg.assistant');
    if (all.length && all[all.length - 1].textContent) window.__updates++;
  }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
}"""


# test-only: lets the test add sampling params (ignore_eos) to the chat frames the page sends
EXTRA_PARAMS = """
const send = WebSocket.prototype.send;
WebSocket.prototype.send = function (data) {
  const f = JSON.parse(data);
  if (f.type === "chat" && window.__extra) data = JSON.stringify(Object.assign(f, window.__extra));
  return send.call(this, data);
};
"""


@contextlib.contextmanager
def chromium():
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: the browser test needs Debian's chromium "
                    f"(apt-get install -y chromium; .ci/run does it)", pytrace=False)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.mark.browser
def test_page_streams_an_answer(server, client):
    with chromium() as browser:
        _chat_in_page(server, client, browser.new_page())


def _chat_in_page(server, client, page) -> None:
    page.set_default_timeout(TIMEOUT_MS)
    page.add_init_script(EXTRA_PARAMS)
    page.goto(server.base_url + "/")
    assert page.title() == "asyncengine chat"
    page.wait_for_function("document.getElementById('status').textContent === 'connected'")
    page.evaluate(WATCH)
    page.evaluate("window.__extra = {ignore_eos: true}")  # 40 tokens for sure, however random the model
    page.fill("#max-tokens", "40")
    page.fill("#temperature", "0")
    page.fill("#input", "Hello there, fox!")
    page.press("#input", "Enter")
    page.locator(".msg.user").first.wait_for()
    assert page.locator(".msg.user").first.text_content() == "Hello there, fox!"
    answer = page.locator(".msg.assistant").first
    page.locator(".msg.assistant[data-done='true']").first.wait_for()
    text = answer.text_content()
    assert text, "the answer bubble stayed empty"
    assert page.evaluate("window.__updates") >= 2, "the answer arrived in one piece, not streamed"
    assert page.text_content("#status").startswith("done (")
    # what the page shows is what the API answers for the same conversation
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there, fox!"}],
                                       max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    assert text == r.choices[0].message.content

    # a long answer, stopped with the Stop button: each step is slowed down (20 ms) so that the
    # 900 tokens cannot all arrive before the click, however fast the machine
    from worker_hooks import restore_execute, slow_steps

    server.engine.core.collective_rpc(slow_steps, (0.02,))
    try:
        page.fill("#max-tokens", "900")
        page.fill("#input", "Now a very long story, please.")
        page.click("#send")
        second = page.locator(".msg.assistant").nth(1)
        page.wait_for_function("document.querySelectorAll('.msg.assistant')[1].textContent.length > 0")
        page.click("#stop")
        page.locator(".msg.assistant[data-done='true']").nth(1).wait_for()
        assert second.get_attribute("data-finish-reason") == "abort"
        assert page.text_content("#status").startswith("done (abort)")
    finally:
        server.engine.core.collective_rpc(restore_execute)
    page.close()
    server.wait_clean("the stopped answer's blocks to be freed")


@pytest.mark.browser
def test_page_sends_the_key_as_a_subprotocol_never_in_a_url(strict_server):
    """With an API key: the page takes it from its #fragment (never sent to the server), drops it from
    the address bar, and opens the websocket with it as a subprotocol: no URL ever carries it."""
    from live_server import API_KEY

    with chromium() as browser:
        page = browser.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        urls: list[str] = []
        page.on("request", lambda r: urls.append(r.url))
        page.on("websocket", lambda ws: urls.append(ws.url))
        page.goto(strict_server.base_url + "/#api_key=" + API_KEY)
        page.wait_for_function("document.getElementById('status').textContent === 'connected'")
        assert any(u.endswith("/v1/ws/chat") for u in urls), urls
        assert all(API_KEY not in u for u in urls), urls
        assert API_KEY not in page.url
        page.fill("#max-tokens", "3")
        page.fill("#input", "hi")
        page.press("#input", "Enter")
        page.locator(".msg.assistant[data-done='true']").first.wait_for()
        assert page.text_content("#status").startswith("done (")
        page.close()
    strict_server.wait_clean()


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory):
    """A live server over the tiny LLaVA (tests/vlm_utils.py)."""
    from live_server import LiveServer, make_engine
    from vlm_utils import make_tiny_llava

    d = make_tiny_llava(str(tmp_path_factory.mktemp("llava_web")))
    s = LiveServer(make_engine(d, num_kv_blocks=64), own_engine=True).start()
    yield s
    s.stop()


@pytest.mark.browser
def test_page_sends_an_image(vlm_server):
    """The Image button: a PNG chosen in the page goes as an image_url part (a data: URL) with the
    text; the answer streams in, and it is what the API answers for the same image and text."""
    import openai
    from vlm_utils import data_url, image, image_message, png_bytes

    png = png_bytes(image(12, (45, 33)))
    with chromium() as browser:
        page = browser.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.add_init_script(EXTRA_PARAMS)
        page.goto(vlm_server.base_url + "/")
        page.wait_for_function("document.getElementById('status').textContent === 'connected'")
        page.evaluate(WATCH)
        page.evaluate("window.__extra = {ignore_eos: true}")
        page.fill("#max-tokens", "12")
        page.fill("#temperature", "0")
        page.set_input_files("#image-file", files=[{"name": "pic.png", "mimeType": "image/png", "buffer": png}])
        page.locator("#attachment img").wait_for()
        page.fill("#input", "What is this?")
        page.press("#input", "Enter")
        page.locator(".msg.user img").first.wait_for()
        page.locator(".msg.assistant[data-done='true']").first.wait_for()
        text = page.locator(".msg.assistant").first.text_content()
        assert text, "the answer bubble stayed empty"
        assert page.evaluate("window.__updates") >= 2, "the answer arrived in one piece, not streamed"
        assert page.locator("#attachment img").count() == 0  # sent: no longer pending
        assert page.locator(".msg.user").first.text_content() == "What is this?"
        page.close()
    c = openai.OpenAI(base_url=vlm_server.base_url + "/v1", api_key="x", max_retries=0)
    r = c.chat.completions.create(model=MODEL, messages=image_message(data_url(png), text="What is this?"),
                                  max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert text == r.choices[0].message.content
    vlm_server.wait_clean()
