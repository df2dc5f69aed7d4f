"""A request's image URLs -> decoded, preprocessed images, or a 400 that says what is wrong with one.

- `data:image/...;base64,...` URLs are decoded in place.
- http(s) URLs are fetched only from the hosts `--allowed-media-domains` names (vLLM's flag; none by default),
  under a byte limit and a time limit, without following redirects (a redirect could leave the allow-list).
- The bytes are read with Pillow: PNG, JPEG, WebP, or GIF (its first frame), converted to RGB. The pixel count
  is checked from the header before any pixel is decoded, so a small file claiming a giant image costs nothing.
- The checkpoint's image processor (engine/image_processor.py) then resizes (within a smaller pixel budget for
  `detail: "low"`), normalises and patches it.
Decoding and preprocessing run on a worker thread: the event loop keeps streaming meanwhile.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from mili_openai.config import MediaConfig
from mili_openai.engine.image_inputs import TEXT_ONLY_MODEL, ImageFeatures
from mili_openai.engine.image_processor import ImagePreprocessor
from mili_openai.protocol.chat import ChatCompletionRequest, ImageURL
from mili_openai.protocol.errors import APIError

if TYPE_CHECKING:
    from PIL.Image import Image

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
DATA_URL_PREFIX = "data:"
BASE64_MARKER = ";base64"
FETCH_CHUNK_BYTES = 64 * 1024


def _bad_image(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_image")


def _data_url_bytes(url: str, limits: MediaConfig, param: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(BASE64_MARKER):
        raise _bad_image("an image data URL must be base64: data:image/<type>;base64,<data>", param)
    media_type = header[len(DATA_URL_PREFIX): -len(BASE64_MARKER)]
    if not media_type.startswith("image/"):
        raise _bad_image(f"a data URL of type {media_type!r} is not an image", param)
    if len(payload) * 3 // 4 > limits.max_image_bytes:
        raise _bad_image(f"the image is larger than {limits.max_image_bytes} bytes", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _bad_image("the image data URL is not valid base64", param) from None


async def _fetched_bytes(url: str, limits: MediaConfig, param: str) -> bytes:
    import aiohttp

    host = (urlsplit(url).hostname or "").lower()
    if host not in {domain.lower() for domain in limits.allowed_domains}:
        raise APIError(400, f"image URLs from {host or url!r} are not allowed: send the image as a data URL, or "
                            "start the server with --allowed-media-domains naming the host", param=param,
                       code="image_url_not_allowed")
    timeout = aiohttp.ClientTimeout(total=limits.fetch_timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(url, allow_redirects=False) as response:
                if response.status != 200:
                    raise _bad_image(f"fetching the image URL answered HTTP {response.status}", param)
                body = bytearray()
                async for chunk in response.content.iter_chunked(FETCH_CHUNK_BYTES):
                    body += chunk
                    if len(body) > limits.max_image_bytes:
                        raise _bad_image(f"the image is larger than {limits.max_image_bytes} bytes", param)
                return bytes(body)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise _bad_image(f"the image URL could not be fetched: {type(exc).__name__}", param) from None


def decode_image(data: bytes, limits: MediaConfig, param: str) -> Image:
    """The image as RGB; a 400 for bytes that are not a whole PNG/JPEG/WebP/GIF image within the limits."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        if image.format not in IMAGE_FORMATS:
            raise _bad_image(f"images must be {', '.join(IMAGE_FORMATS)}; got {image.format}", param)
        width, height = image.size
        if width * height > limits.max_image_pixels:
            raise _bad_image(f"the image is {width} x {height} pixels, over the limit of {limits.max_image_pixels}",
                             param)
        image.seek(0)  # a GIF's (or animated WebP's) first frame
        image.load()
        return image.convert("RGB")
    except APIError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError):
        raise _bad_image("the image could not be decoded (not a PNG, JPEG, WebP or GIF image)", param) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise _bad_image(f"the image could not be decoded: {exc}", param) from None


def _preprocessed(data: bytes, limits: MediaConfig, preprocess: ImagePreprocessor, param: str,
                  detail: str | None) -> ImageFeatures:
    image = decode_image(data, limits, param)
    try:
        return preprocess(image, detail)
    except ValueError as exc:  # e.g. an aspect ratio the processor refuses
        raise _bad_image(f"the image cannot be used: {exc}", param) from None


async def load_images(urls: list[tuple[ImageURL, str]], limits: MediaConfig,
                      preprocess: ImagePreprocessor | None) -> list[ImageFeatures]:
    """`urls`: (image URL and detail, the request field it came from) in prompt order -> each image's features."""
    if not urls:
        return []
    if preprocess is None:
        raise APIError(400, TEXT_ONLY_MODEL, param=urls[0][1], code="images_not_supported")
    if len(urls) > limits.max_images_per_request:
        raise APIError(400, f"the request has {len(urls)} images; at most {limits.max_images_per_request} are "
                            "allowed", param=urls[0][1], code="too_many_images")
    images = []
    for image_url, param in urls:
        url = image_url.url
        if url.startswith(DATA_URL_PREFIX):
            data = _data_url_bytes(url, limits, param)
        elif url.startswith(("http://", "https://")):
            data = await _fetched_bytes(url, limits, param)
        else:
            raise _bad_image("an image URL must be a data URL or an http(s) URL", param)
        images.append(await asyncio.to_thread(_preprocessed, data, limits, preprocess, param, image_url.detail))
    return images


def request_image_urls(request: ChatCompletionRequest) -> list[tuple[ImageURL, str]]:
    """Every image part's URL and detail, with the field it sits in, in the order the prompt places them."""
    return [(url, f"messages[{index}].content") for index, message in enumerate(request.messages)
            for url in message.image_urls()]
