"""Images in the framework adapters' chat messages (LangChain, LlamaIndex), as the OpenAI server
takes them (openai_server/media.py): each image becomes the model's image token in its message's
text, where it stands, and its data joins the request's images in order; the chat is rendered here
and submitted as token ids with ``multi_modal_data`` (decoded, checked and processed by the engine
like any other image: asyncengine/multimodal/image_io.py).

What an adapter accepts is what the engine decodes in-process: a ``data:image/...;base64,`` URL,
the encoded bytes, or a local file the app names. ``http(s)`` URLs are refused: an adapter that
fetched any URL a message names could be made to reach the app's own network (the server fetches
only hosts ``--allowed-media-domains`` lists); download it and pass the bytes."""
from __future__ import annotations

from asyncengine.engine.processor import render_chat_checked

def image_token(engine) -> str | None:
    """The model's image token as text (what an image in a message becomes); None: no images. (The
    front end's image processor, read as the server's media.processor_of reads it: the engine
    client protocol has no member for it.)"""
    mm = getattr(getattr(engine, "processor", None), "mm", None)
    tok = getattr(engine, "tokenizer", None)
    return None if mm is None or tok is None else tok.convert_ids_to_tokens(mm.image_token_id)


def image_from_url(url) -> str:
    """An image URL a message names, as what the engine decodes: only ``data:`` URLs."""
    if not isinstance(url, str) or not url:
        raise ValueError("an image needs a URL or its data")
    if not url.startswith("data:"):
        raise ValueError(f"image URLs other than data: URLs are not fetched ({url[:40]!r}); "
                         "download the image and pass its bytes or a data: URL")
    return url


def image_from_base64(data: str, mime_type: str | None) -> str:
    """Base64 image data and its MIME type as a data URL."""
    if not isinstance(data, str) or not data:
        raise ValueError("an image block needs its base64 data")
    return f"data:{mime_type or 'image/png'};base64,{data}"


def chat_prompt(engine, messages: list[dict], images: list):
    """What to submit: the messages themselves, or, with images, the chat rendered to token ids
    (one image token per image, in order) with the images as ``multi_modal_data``."""
    if not images:
        return messages
    ids = render_chat_checked(engine.tokenizer, engine.check_messages(messages))
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
