"""Images in chat messages: OpenAI ``image_url`` content parts to the engine's ``multi_modal_data``.

Each part becomes the model's image token in the message text (where the image goes) and its
source joins the request's images, in order. Sources: ``data:image/...;base64,`` URLs (always);
``file:`` URLs and plain paths only under ``--allowed-local-media-path``; ``http(s):`` URLs only on a
host ``--allowed-media-domains`` lists (off by default: a server that fetches any URL a client names
can be made to reach its own network). Too many images, and sizes, are refused here before any
fetch; decoding and its checks are the engine's (asyncengine/multimodal/image_io.py): a 400 either way."""
from __future__ import annotations

import asyncio
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass

import msgspec

from .errors import APIError

FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MediaPolicy:
    allowed_domains: tuple[str, ...] = ()  # hosts whose http(s) image URLs the server fetches
    allowed_local_path: str | None = None  # a folder whose files file: URLs may name


def processor_of(engine):
    """The engine's MultiModalProcessor (asyncengine/multimodal/processor.py), or None: no images."""
    return getattr(getattr(engine, "processor", None), "mm", None)


def split_images(messages: list, engine) -> tuple[list, list]:
    """(messages with each image part as the image token's text, the image URLs in order)."""
    urls: list[str] = []
    out = []
    mm = processor_of(engine)
    limit = mm.limits.max_images if mm is not None else 0
    for i, m in enumerate(messages):
        content = m.content
        if not isinstance(content, list) or not any(p.type == "image_url" for p in content):
            out.append(m)
            continue
        if mm is None or engine.tokenizer is None:
            j = next(j for j, p in enumerate(content) if p.type == "image_url")
            raise APIError(400, "this model takes no images", param=f"messages[{i}].content[{j}]")
        token = mm.image_part_text(engine.tokenizer)
        parts = []
        for j, p in enumerate(content):
            if p.type != "image_url":
                parts.append(p)
                continue
            url = p.image_url.get("url") if isinstance(p.image_url, dict) else None
            if not isinstance(url, str) or not url:
                raise APIError(400, "an image_url part needs {\"url\": ...}", param=f"messages[{i}].content[{j}]")
            urls.append(url)
            if len(urls) > limit:
                raise APIError(400, f"more than {limit} images in one request (--limit-mm-per-prompt)",
                               param="messages")
            parts.append(type(p)(type="text", text=token))
        out.append(msgspec.structs.replace(m, content=parts))
    return out, urls


async def load_sources(urls: list[str], policy: MediaPolicy, max_bytes: int) -> list:
    """Each URL as what the engine decodes: a data URL as it is, a file's or a download's bytes."""
    return [await _source(u, policy, max_bytes) for u in urls]


async def _source(url: str, policy: MediaPolicy, max_bytes: int):
    if url.startswith("data:"):
        return url
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme in ("http", "https"):
        host = (parsed.hostname or "").lower()
        if host not in policy.allowed_domains:
            raise APIError(400, f"image URLs from {host or 'that host'!r} are not allowed (the server fetches only "
                                "hosts --allowed-media-domains lists; send a data: URL)", param="messages")
        return await asyncio.to_thread(_fetch, url, max_bytes)
    if parsed.scheme in ("file", ""):
        return await asyncio.to_thread(_read_local, parsed.path if parsed.scheme else url, policy, max_bytes)
    raise APIError(400, f"image URL scheme {parsed.scheme!r:.20} is not supported (data:, http(s):, file:)",
                   param="messages")


def _read_local(path: str, policy: MediaPolicy, max_bytes: int) -> bytes:
    root = policy.allowed_local_path
    if root is None:
        raise APIError(400, "local image files are not allowed (start the server with --allowed-local-media-path)",
                       param="messages")
    real, base = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, base]) != base or not os.path.isfile(real):
        raise APIError(400, "that image file is not under --allowed-local-media-path", param="messages")
    if os.path.getsize(real) > max_bytes:
        raise APIError(400, f"the image is over {max_bytes} bytes", param="messages")
    with open(real, "rb") as f:
        return f.read(max_bytes + 1)


def _fetch(url: str, max_bytes: int) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as r:  # noqa: S310 (host checked above)
            data = r.read(max_bytes + 1)
    except OSError as e:
        raise APIError(400, f"cannot fetch the image ({type(e).__name__})", param="messages") from None
    if len(data) > max_bytes:
        raise APIError(400, f"the image is over {max_bytes} bytes", param="messages")
    return data
