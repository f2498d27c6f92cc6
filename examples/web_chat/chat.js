// The web chat page: talks to /v1/ws/chat (see integrations/openai_server/websocket.py for the
// protocol). Plain JS, no build step, no external resources. An API key, when the server wants one,
// is taken from the page's ?api_key=... and passed on to the websocket.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const messages = $("messages"), input = $("input"), send = $("send"), stop = $("stop"), status = $("status");
  const history = [];          // the conversation so far, as OpenAI chat messages
  let ws = null, nextId = 1, current = null;   // current: {id, el, text} of the answer being streamed

  function bubble(role, text) {
    const el = document.createElement("div");
    el.className = "msg " + role;
    el.textContent = text;
    messages.appendChild(el);
    messages.scrollTop = messages.scrollHeight;
    return el;
  }

  function setBusy(busy) {
    send.disabled = busy || !ws || ws.readyState !== WebSocket.OPEN;
    stop.disabled = !busy;
  }

  function connect() {
    const key = new URLSearchParams(location.search).get("api_key");
    const url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/v1/ws/chat" +
      (key ? "?api_key=" + encodeURIComponent(key) : "");
    ws = new WebSocket(url);
    ws.onopen = () => { status.textContent = "connected"; setBusy(false); };
    ws.onclose = () => {
      status.textContent = "disconnected — reconnecting…";
      if (current) finish("abort");
      setBusy(false);
      setTimeout(connect, 1000);
    };
    ws.onmessage = (ev) => {
      const f = JSON.parse(ev.data);
      if (!current || f.id !== current.id) return;   // an old, cancelled answer
      if (f.type === "delta") {
        current.text += f.text;
        current.el.textContent = current.text;
        messages.scrollTop = messages.scrollHeight;
      } else if (f.type === "done") {
        finish(f.finish_reason, f.usage);
      } else if (f.type === "error") {
        current.el.className = "msg error";
        current.el.textContent = "error: " + f.error.message;
        history.pop();   // the question that failed
        current = null;
        status.textContent = "error";
        setBusy(false);
      }
    };
  }

  function finish(reason, usage) {
    const c = current;
    current = null;
    c.el.dataset.done = "true";
    c.el.dataset.finishReason = reason;
    history.push({ role: "assistant", content: c.text });
    status.textContent = "done (" + reason + ")" +
      (usage ? ", " + usage.completion_tokens + " tokens" : "");
    setBusy(false);
  }

  function ask() {
    const text = input.value.trim();
    if (!text || current || !ws || ws.readyState !== WebSocket.OPEN) return;
    input.value = "";
    bubble("user", text);
    history.push({ role: "user", content: text });
    current = { id: nextId++, el: bubble("assistant", ""), text: "" };
    // blank fields are left out: the server then uses the model's defaults (its generation
    // config, else the engine's small-chat defaults) and answers until the model stops
    const frame = { type: "chat", id: current.id, messages: history };
    const maxTokens = parseInt($("max-tokens").value, 10);
    if (maxTokens > 0) frame.max_tokens = maxTokens;
    const temperature = parseFloat($("temperature").value);
    if (!Number.isNaN(temperature)) frame.temperature = temperature;
    ws.send(JSON.stringify(frame));
    status.textContent = "generating…";
    setBusy(true);
  }

  $("form").addEventListener("submit", (e) => { e.preventDefault(); ask(); });
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); ask(); }
  });
  stop.addEventListener("click", () => {
    if (current && ws) ws.send(JSON.stringify({ type: "cancel", id: current.id }));
  });
  $("reset").addEventListener("click", () => {
    if (current && ws) ws.send(JSON.stringify({ type: "cancel", id: current.id }));
    current = null;
    history.length = 0;
    messages.textContent = "";
    status.textContent = "new chat";
    setBusy(false);
  });
  connect();
})();
