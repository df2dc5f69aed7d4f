"""`LLM.chat`'s conversations -> the prompts `LLM.generate` takes, as vLLM's offline chat renders them: the model's
chat template over OpenAI-format messages, each image part one placeholder where it sits (the template writes it)
and its image in `multi_modal_data`.

Image parts are `{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}` (offline, only data
URLs: nothing is fetched) or vLLM's `{"type": "image_pil", "image_pil": image}` (a PIL image or an (H, W, 3) uint8
array)."""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

IMAGE_URL, IMAGE_PIL, TEXT = "image_url", "image_pil", "text"
DATA_URL_PREFIX = "data:"


def chat_prompt(tokenizer: Any, messages: list[dict[str, Any]], template_kwargs: dict[str, Any],
                add_generation_prompt: bool) -> str | dict[str, Any]:
    """One conversation as `LLM.generate`'s prompt: its rendered text, with its images when it has some.
    ValueError for a content part that is neither text nor an image, or an image URL that is not a data URL."""
    images: list[Any] = []
    rendered = [_template_message(message, images) for message in messages]
    text = tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def _template_message(message: dict[str, Any], images: list[Any]) -> dict[str, Any]:
    """The message as the template reads it (image parts as `{"type": "image"}`); its images appended to `images`."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == TEXT:
            parts.append({"type": TEXT, "text": part[TEXT]})
        elif kind in (IMAGE_URL, IMAGE_PIL):
            images.append(part[IMAGE_PIL] if kind == IMAGE_PIL else _data_url_image(part[IMAGE_URL]))
            parts.append({"type": "image"})
        else:
            raise ValueError(f"content parts of type {kind!r} are not supported offline: only {TEXT!r}, "
                             f"{IMAGE_URL!r} (data URLs) and {IMAGE_PIL!r} are")
    return {**message, "content": parts}


def _data_url_image(image_url: Any) -> Any:
    """The PIL image a data URL holds."""
    from PIL import Image, UnidentifiedImageError

    url = image_url.get("url", "") if isinstance(image_url, dict) else str(image_url)
    header, _, payload = url.partition(",")
    if not (header.startswith(DATA_URL_PREFIX) and header.endswith(";base64")):
        raise ValueError("offline image URLs must be base64 data URLs (data:image/<type>;base64,<data>); nothing is "
                         "fetched: pass a PIL image as an image_pil part instead")
    try:
        return Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
    except (binascii.Error, UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"the image data URL could not be decoded: {exc}") from None
