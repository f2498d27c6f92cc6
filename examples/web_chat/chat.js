// The web chat page: talks to /v1/ws/chat (its frames: docs/integrations.md, "The websocket chat").
// Reasoning frames are shown apart and not sent back as history. The Image button attaches a picture
// to the next message (an image_url part with a data: URL; larger than 1024 px on a side, it is scaled
// down here first: a websocket frame is bounded by the server's --max-request-bytes). Plain JS, no build step, no external resources. An API key, when the server wants one,
// comes from the "API key" field or the page's #api_key=... fragment (a fragment never reaches the
// server), is kept in sessionStorage, and travels as a websocket subprotocol, never in a URL: URLs
// end up in logs.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const messages = $("messages"), input = $("input"), send = $("send"), stop = $("stop"), status = $("status");
  const history = [];          // the conversation so far, as OpenAI chat messages
  let ws = null, nextId = 1, current = null;   // current: {id, el, text} of the answer being streamed
  const attachment = $("attachment"), fileInput = $("image-file");
  let pendingImage = null;     // a data: URL, sent with the next message
  const MAX_SIDE = 1024, MAX_URL_CHARS = 3 << 20;

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

  function readAsDataURL(file) {
    return new Promise((resolve, reject) => {
      const r = new FileReader();
      r.onload = () => resolve(r.result);
      r.onerror = () => reject(r.error);
      r.readAsDataURL(file);
    });
  }

  async function shrink(url) {   // as it is, or scaled down to MAX_SIDE as a JPEG
    const img = new Image();
    img.src = url;
    await img.decode();   // rejects what the browser cannot read as an image
    const scale = Math.min(1, MAX_SIDE / Math.max(img.naturalWidth, img.naturalHeight));
    if (scale === 1 && url.length <= MAX_URL_CHARS) return url;
    const c = document.createElement("canvas");
    c.width = Math.max(1, Math.round(img.naturalWidth * scale));
    c.height = Math.max(1, Math.round(img.naturalHeight * scale));
    c.getContext("2d").drawImage(img, 0, 0, c.width, c.height);
    return c.toDataURL("image/jpeg", 0.9);
  }

  function showAttachment() {
    attachment.textContent = "";
    if (!pendingImage) return;
    const img = document.createElement("img");
    img.src = pendingImage;
    img.alt = "image to send";
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "Remove image";
    remove.addEventListener("click", () => { pendingImage = null; showAttachment(); });
    attachment.append(img, remove);
  }

  $("attach").addEventListener("click", () => fileInput.click());
  fileInput.addEventListener("change", async () => {
    const file = fileInput.files[0];
    fileInput.value = "";
    if (!file) return;
    try {
      pendingImage = await shrink(await readAsDataURL(file));
    } catch (e) {
      pendingImage = null;
      status.textContent = "not an image: " + file.name;
    }
    showAttachment();
  });

  function ask() {
    const text = input.value.trim();
    if ((!text && !pendingImage) || current || !ws || ws.readyState !== WebSocket.OPEN) return;
    input.value = "";
    const el = bubble("user", text);
    let content = text;
    if (pendingImage) {   // OpenAI content parts: the image, then the text
      const img = document.createElement("img");
      img.src = pendingImage;
      img.alt = "image sent";
      el.prepend(img);
      content = [{ type: "image_url", image_url: { url: pendingImage } }];
      if (text) content.push({ type: "text", text: text });
      pendingImage = null;
      showAttachment();
    }
    history.push({ role: "user", content: content });
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
    pendingImage = null;
    showAttachment();
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
