"""Images -> model inputs, as the checkpoint's processor makes them: transformers' own Qwen2-VL image processor (its
Pillow backend) configured from the checkpoint's preprocessor_config.json (smart resize between the min and max
pixel counts to a multiple of patch_size x merge_size, rescale, normalise, patches in merge-block order; a smaller
budget for OpenAI's `detail: "low"`), and the prompt's placeholders expanded as transformers' Qwen3-VL processor
expands them: each `<|image_pad|>` the chat template writes becomes as many as the image has merged patches."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import numpy as np

from mili_openai.engine.image_inputs import ImageFeatures

if TYPE_CHECKING:
    from PIL.Image import Image

    from mili_openai.model.vision_config import VisionSpec

# preprocessor_config.json keys that configure the image processor (others name classes or the video side)
PROCESSOR_KEYS = ("size", "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
                  "image_mean", "image_std", "do_resize", "do_rescale", "rescale_factor", "do_normalize",
                  "do_convert_rgb", "resample")
LOW_DETAIL = "low"
# a `detail: "low"` image's pixel budget: OpenAI's low-detail image is 512 x 512
LOW_DETAIL_PIXELS = 512 * 512


class ImagePreprocessor:
    """One per model: PIL images -> `ImageFeatures` (patches, grid, digest)."""

    def __init__(self, spec: VisionSpec) -> None:
        from transformers import Qwen2VLImageProcessorPil

        self.spec = spec
        settings = {key: value for key, value in spec.preprocessor.items() if key in PROCESSOR_KEYS}
        self.processor = Qwen2VLImageProcessorPil(**settings)
        self._settings_digest = repr(sorted(settings.items())).encode()
        bounds = self.processor.size  # the pixel count bounds smart resize keeps an image within
        self.low_detail_size = {"shortest_edge": min(bounds["shortest_edge"], LOW_DETAIL_PIXELS),
                                "longest_edge": min(bounds["longest_edge"], LOW_DETAIL_PIXELS)}

    def __call__(self, image: Image, detail: str | None = None) -> ImageFeatures:
        """ValueError for an image the processor refuses (e.g. an aspect ratio past 200:1). `detail` "low" (OpenAI's
        image parts): resized to at most LOW_DETAIL_PIXELS; else within the checkpoint's bounds."""
        low = detail == LOW_DETAIL
        out = self.processor(images=[image], return_tensors="np", **({"size": self.low_detail_size} if low else {}))
        pixel_values = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        digest = hashlib.sha256(self._settings_digest)
        digest.update(np.asarray(grid, dtype=np.int64).tobytes())
        digest.update(pixel_values.tobytes())
        return ImageFeatures(pixel_values, grid, self.spec.spatial_merge_size, digest.hexdigest())


def expand_image_placeholders(token_ids: list[int], images: list[ImageFeatures], image_token_id: int) -> list[int]:
    """Each single `image_token_id` (one per image, in order, as the chat template writes them) repeated to its
    image's token count. ValueError when the prompt places a different number of images."""
    count = sum(1 for token in token_ids if token == image_token_id)
    if count != len(images):
        raise ValueError(f"the prompt has {count} image placeholders for {len(images)} images")
    remaining = iter(images)
    out: list[int] = []
    for token in token_ids:
        out.extend([token] * next(remaining).num_tokens if token == image_token_id else (token,))
    return out


def as_rgb_image(value: Any) -> Image:
    """A PIL image, or an (H, W, 3) uint8 array, as an RGB PIL image (the offline API's `multi_modal_data`)."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    array = np.asarray(value)
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise ValueError(f"an image must be a PIL image or an (H, W, 3) uint8 array, got {array.dtype} {array.shape}")
    return Image.fromarray(array, "RGB")
