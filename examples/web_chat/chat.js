// The web chat page: talks to /v1/ws/chat (its frames: docs/integrations.md, "The websocket chat").
// Reasoning frames are shown apart and not sent back as history. Plain JS, no build step, no external resources. An API key, when the server wants one,
// comes from the "API key" field or the page's #api_key=... fragment (a fragment never reaches the
// server), is kept in sessionStorage, and travels as a websocket subprotocol, never in a URL: URLs
// end up in logs.
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

  const KEY = "asyncengine_api_key";
  function apiKey() {
    const fromHash = new URLSearchParams(location.hash.slice(1)).get("api_key");
    if (fromHash) {
      sessionStorage.setItem(KEY, fromHash);
      window.history.replaceState(null, "", location.pathname + location.search);   // out of the address bar
    }
    return sessionStorage.getItem(KEY) || "";
  }

  function b64url(s) {   // UTF-8, base64url without padding: a valid subprotocol token
    const bytes = new TextEncoder().encode(s);
    let bin = "";
    for (const b of bytes) bin += String.fromCharCode(b);
    return btoa(bin).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  }

  function connect() {
    const key = apiKey();
    const protocols = ["asyncengine.v1"];
    if (key) protocols.push("asyncengine.key." + b64url(key));
    const url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/v1/ws/chat";
    ws = new WebSocket(url, protocols);
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
      if (f.type === "reasoning") {   // the model's thinking, shown apart (serve --reasoning-parser)
        if (!current.thinking) {
          current.thinking = document.createElement("div");
          current.thinking.className = "msg reasoning";
          messages.insertBefore(current.thinking, current.el);
        }
        current.thinking.textContent += f.text;
        messages.scrollTop = messages.scrollHeight;
      } else if (f.type === "delta") {
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
  const keyInput = $("api-key");
  keyInput.value = apiKey();
  keyInput.addEventListener("change", () => {
    sessionStorage.setItem(KEY, keyInput.value);
    if (ws) ws.close();   // reconnects with the new key
  });
  connect();
})();
