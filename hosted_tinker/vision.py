"""Images for vision-language models: an `ImageChunk` turned into the model's own inputs.

A datum's model_input may hold image chunks between its text chunks. The model's image processor
(its `preprocessor_config.json`) turns each image into pixel patches and a grid; the image takes
grid / merge_size^2 positions in the sequence, each the model's image token (`<|image_pad|>` for
Qwen-VL), which the model's forward replaces with the vision tower's embeddings. A chunk's
`expected_tokens`, when set, must equal that count: the client sized its targets and weights by it.

Bounds: every image is at most `max_image_bytes` encoded and `max_image_pixels` decoded, and a
request holds at most `max_images_per_request` of them (config.py); a refusal names the setting.
An API key's waiting and running requests, training and sampling alike, hold at most
`max_image_pixels_per_key` pixels of images together (services/images.py).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import UserError

FORMATS = {"png": "PNG", "jpeg": "JPEG"}


class ImageError(UserError):
    """An image the request cannot use (a 400)."""


class MissingPackage(RuntimeError):
    """A package the server needs for what it was asked to serve is not installed (one line: what to install)."""


@dataclass
class ImageIn:
    """One image chunk of a model_input, before it is processed."""

    position: int  # tokens of the model_input before it
    data: bytes
    format: str  # "png" | "jpeg"
    expected_tokens: int | None = None


@dataclass
class ImageLimits:
    max_image_bytes: int
    max_image_pixels: int
    max_images_per_request: int


@dataclass
class Pixels:
    """One datum's images as the model's forward takes them (in the order of their tokens)."""

    pixel_values: torch.Tensor  # [patches, patch_dim] float32
    grid_thw: torch.Tensor  # [images, 3] int64
    image_pixels: int  # width x height of the images as sent, summed: what a key's image bound counts


def total_pixels(pixels: Iterable[Pixels | None]) -> int:
    """Width x height of the images as sent, summed over `pixels` (None: an input without images):
    what a key's image bound, `max_image_pixels_per_key`, counts."""
    return sum(p.image_pixels for p in pixels if p is not None)


class ImageEncoder:
    """A served vision-language model's image processor and image token."""

    def __init__(self, processor: Any, image_token_id: int, limits: ImageLimits):
        self.processor = processor
        self.image_token_id = image_token_id
        self.merge = int(getattr(processor, "merge_size", 1))
        self.limits = limits

    def expand(self, where: str, tokens: np.ndarray, images: list[ImageIn]) -> tuple[np.ndarray, Pixels]:
        """`tokens` with each image's placeholder tokens inserted at its position, and the pixels."""
        parts, values, grids, start, image_pixels = [], [], [], 0, 0
        for j, image in enumerate(images):
            pixel_values, grid, size = self._process(f"{where} image {j}", image)
            image_pixels += size
            n = int(grid.prod()) // self.merge ** 2
            if image.expected_tokens is not None and image.expected_tokens != n:
                raise ImageError(f"{where} image {j}: expected_tokens is {image.expected_tokens}, but this model's "
                                 f"processor makes {n} tokens of this {image.format} image")
            parts += [tokens[start:image.position], np.full(n, self.image_token_id, dtype=np.int64)]
            start = image.position
            values.append(pixel_values)
            grids.append(grid)
        parts.append(tokens[start:])
        return np.concatenate(parts), Pixels(torch.cat(values), torch.cat(grids), image_pixels)

    def _process(self, where: str, image: ImageIn) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The image's pixel patches, its grid, and its pixels (width x height)."""
        from PIL import Image

        limits = self.limits
        if len(image.data) > limits.max_image_bytes:
            raise ImageError(f"{where}: {len(image.data)} bytes; at most {limits.max_image_bytes} (max_image_bytes)")
        if image.format not in FORMATS:
            raise ImageError(f"{where}: format {image.format[:16]!r} is not one of {sorted(FORMATS)}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                pil = Image.open(io.BytesIO(image.data))
                if pil.format != FORMATS[image.format]:
                    raise ImageError(f"{where}: the data is {pil.format or 'not an image'}, not {image.format}")
                width, height = pil.size
                if width * height > limits.max_image_pixels:
                    raise ImageError(f"{where}: {width}x{height} is {width * height} pixels; at most "
                                     f"{limits.max_image_pixels} (max_image_pixels)")
                pil = pil.convert("RGB")
        except ImageError:
            raise
        except Exception as e:  # PIL's many ways of saying "not a valid image"
            raise ImageError(f"{where}: the data is not a valid {image.format} image ({type(e).__name__})") from None
        out = self.processor(images=[pil], return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"].long(), width * height

    def check_count(self, n_images: int) -> None:
        if n_images > self.limits.max_images_per_request:
            raise ImageError(f"{n_images} images in one request; at most {self.limits.max_images_per_request} "
                             "(max_images_per_request)")


def require_pillow(model: str) -> None:
    """A `MissingPackage` saying what to install if Pillow, which images need, is not installed."""
    try:
        import PIL.Image  # noqa: F401
    except ImportError:
        raise MissingPackage(f"{model} is a vision-language model and its images need Pillow, which is not "
                             "installed: pip install pillow (./launch.sh serve installs it)") from None


def image_encoder(model: torch.nn.Module, source: str, limits: ImageLimits) -> ImageEncoder | None:
    """The encoder of a vision-language model loaded from `source`; None for a text-only model."""
    token = getattr(model.config, "image_token_id", None)
    if token is None or getattr(model.config, "vision_config", None) is None:
        return None
    require_pillow(source)
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(source, backend="pil")  # no torchvision needed
    return ImageEncoder(processor, int(token), limits)


def no_images(where: str, model_name: str) -> ImageError:
    return ImageError(f"{where}: an image chunk, but {model_name} takes no images (a text-only model); "
                      "send text chunks only")
