"""Images for vision-language models: an `ImageChunk` turned into the model's own inputs.

A datum's model_input may hold image chunks between its text chunks. The model's image processor
(its `preprocessor_config.json`) turns each image into pixel patches and a grid; the image takes
grid / merge_size^2 positions in the sequence, each the model's image token (`<|image_pad|>` for
Qwen-VL), which the model's forward replaces with the vision tower's embeddings. A chunk's
`expected_tokens`, when set, must equal that count: the client sized its targets and weights by it.

An image goes through three steps, so that nothing is decoded for a request that is refused, and
a queued request holds its images as sent (image_decodes.py says where each step runs, and why):

1. `ImageEncoder.expand`, while the request is validated, reads each image's header only (PIL's
   `Image.open` is lazy: format and size, no pixels): its bytes, format and pixels against the
   bounds, the processor's own size rules (an aspect ratio it refuses) and its token count (the
   processor's `get_number_of_image_patches`, the count the cookbook's `expected_tokens` comes
   from), and puts the image's placeholder tokens into the sequence. The text is checked against
   what the model's forward needs: in a request with images no text token is the image
   placeholder (the forward would find more image tokens than image features and fail the whole
   micro-batch), and two images have text between them (the multimodal rotary positions read
   adjacent images' tokens as one image; the model's chat template wraps each image in its
   vision start and end tokens).
2. `ImageEncoder.check`, once the key's image budget holds the request (services/images.py) and
   before it is queued, decodes each image and lets its pixels go: a file cut short is refused.
3. `ImageEncoder.decode`, shortly before the request's pass or prefill (`Pixels.ready`), decodes
   and processes the pixels, and checks that they are what the header promised.

Bounds: every image is at most `max_image_bytes` encoded and `max_image_pixels` decoded, and a
request holds at most `max_images_per_request` of them (config.py); a refusal names the setting.
An API key's waiting and running requests, training and sampling alike, hold at most
`max_image_pixels_per_key` pixels of images together, each image counted at the larger of its
size as sent (what decoding it holds) and its size as the processor resizes it (what its request
holds until answered: Qwen-VL's float32 patches take 24 bytes a pixel), and run at most
`max_image_decodes_per_key` decodes at once; the server runs at most `max_image_decodes`
(image_decodes.py).
"""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from ..errors import UserError

log = logging.getLogger(__name__)

FORMATS = {"png": "PNG", "jpeg": "JPEG"}
# 16-bit grayscale (PNG): PIL's own conversion to RGB clips it at 255, which turns nearly all of it white.
SIXTEEN_BIT_GRAY = ("I;16", "I;16B", "I;16L", "I")


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
class SizedImage:
    """An image chunk checked from its header alone (`ImageEncoder.measure`)."""

    where: str  # "datum 0 image 1": what a refusal names
    data: bytes  # as sent: what the request holds until its images are processed for its pass
    format: str
    width: int
    height: int
    patches: int  # the processor's patches of it, each patch_size x patch_size pixels
    tokens: int  # its placeholder tokens in the sequence: patches / merge_size^2
    processed_pixels: int  # its pixels once the processor has resized it

    @property
    def budget_pixels(self) -> int:
        """What the key's image budget counts: the larger of what decoding it and what holding it takes."""
        return max(self.width * self.height, self.processed_pixels)


@dataclass
class Pixels:
    """One datum's images (or one prompt's), in the order of their tokens: sized from their headers
    when the request is validated, held as sent while it waits, decoded (`ImageEncoder.decode`)
    shortly before its pass or prefill: what plans it asks `ready()` first, and the device loop
    only ever sees `pixel_values` and `grid_thw` set."""

    images: list[SizedImage]
    pixel_values: torch.Tensor | None = None  # [patches, patch_dim] float32, once decoded
    grid_thw: torch.Tensor | None = None  # [images, 3] int64, once decoded
    error: Exception | None = None  # why they could not be decoded (an `ImageError`: the user's)
    # Asks for the decode, on image_decodes.py's threads (set when the request is queued).
    ask_decode: Callable[["Pixels"], None] | None = field(default=None, repr=False)
    _asked: bool = field(default=False, repr=False)

    @property
    def image_pixels(self) -> int:
        """What a key's image bound, `max_image_pixels_per_key`, counts of these images."""
        return sum(image.budget_pixels for image in self.images)

    def ready(self) -> bool:
        """Whether they are decoded (or failed to be: `error`); if not, their decode is asked for
        (once), and whoever plans them asks again once it is rung."""
        if self.pixel_values is not None or self.error is not None:
            return True
        if not self._asked:
            self._asked = True
            if self.ask_decode is None:
                raise RuntimeError("images were queued without a way to decode them (ImageDecodes.attach)")
            self.ask_decode(self)
        return False

    @property
    def waiting(self) -> bool:
        """Their decode is asked for and not done: whoever needs them has nothing to do with them yet."""
        return self._asked and self.pixel_values is None and self.error is None

    def decoded(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> None:
        self.grid_thw = grid_thw
        self.pixel_values = pixel_values  # last: `ready()` reads it

    def failed(self, error: Exception) -> None:
        self.error = error

    def release(self) -> None:
        """Let the decoded pixels go once they have run (a later `ready()` decodes them again)."""
        self.pixel_values = self.grid_thw = None
        self._asked = False

    def __getstate__(self) -> dict:
        """Sent to a worker pool's ranks: the decoded pixels, not the images as sent nor the decoder."""
        state = dict(self.__dict__, ask_decode=None)
        state["images"] = [replace(image, data=b"") for image in self.images]
        return state


def total_pixels(pixels: Iterable[Pixels | None]) -> int:
    """`Pixels.image_pixels` summed over `pixels` (None: an input without images): what a key's image
    bound, `max_image_pixels_per_key`, counts of a request."""
    return sum(p.image_pixels for p in pixels if p is not None)


@dataclass
class VisionTokens:
    """The tokens of a vision-language model's sequence that its forward or its chat template give a role."""

    image: int  # the image placeholder, one per image token
    image_name: str
    wrap: str | None = None  # how its chat template wraps an image, e.g. "<|vision_start|>...<|vision_end|>"


class ImageEncoder:
    """A served vision-language model's image processor and image tokens."""

    def __init__(self, processor: Any, tokens: VisionTokens, limits: ImageLimits):
        self.processor = processor
        self.tokens = tokens
        self.image_token_id = tokens.image
        self.merge = int(getattr(processor, "merge_size", 1))
        self.limits = limits
        self.decoded = 0  # images decoded (or tried), for /metrics: a refused request decodes none
        self._lock = threading.Lock()

    def expand(self, where: str, tokens: np.ndarray, images: list[ImageIn]) -> tuple[np.ndarray, Pixels]:
        """`tokens` with each image's placeholder tokens inserted at its position, and the images,
        sized from their headers (nothing decoded yet: `decode`)."""
        self.check_text(where, tokens)
        for j in range(1, len(images)):
            if images[j].position == images[j - 1].position:
                wrap = f" (its chat template wraps each image as {self.tokens.wrap})" if self.tokens.wrap else ""
                raise ImageError(f"{where}: images {j - 1} and {j} have no text between them, and this model reads "
                                 f"adjacent images' tokens as one image: put text between them{wrap}")
        sized = [self.measure(f"{where} image {j}", image) for j, image in enumerate(images)]
        parts, start = [], 0
        for image, size in zip(images, sized):
            parts += [tokens[start:image.position], np.full(size.tokens, self.image_token_id, dtype=np.int64)]
            start = image.position
        parts.append(tokens[start:])
        return np.concatenate(parts), Pixels(sized)

    def check_text(self, where: str, tokens: np.ndarray) -> None:
        """An `ImageError` if a text token of a request with images is the image placeholder."""
        found = np.flatnonzero(tokens == self.image_token_id)
        if found.size:
            raise ImageError(f"{where}: its text holds {self.image_token_id} ({self.tokens.image_name}), this model's "
                             f"image placeholder, at index {int(found[0])} of its text tokens, in a request with "
                             "images: the server puts each image's placeholder tokens in itself (as many as its "
                             "processor makes); send each image as an image chunk and keep the placeholder out of "
                             "the text")

    def measure(self, where: str, image: ImageIn) -> SizedImage:
        """`image` checked and sized from its header alone: its format, bytes, pixels and the
        processor's size rules, and its token count against `expected_tokens`."""
        from PIL import Image

        limits = self.limits
        if len(image.data) > limits.max_image_bytes:
            raise ImageError(f"{where}: {len(image.data)} bytes; at most {limits.max_image_bytes} (max_image_bytes)")
        if image.format not in FORMATS:
            raise ImageError(f"{where}: format {image.format[:16]!r} is not one of {sorted(FORMATS)}")
        try:
            with Image.open(io.BytesIO(image.data)) as pil:  # the header only: no pixel is decoded here
                found, (width, height) = pil.format, pil.size
        except Image.DecompressionBombError:
            raise ImageError(f"{where}: its header claims more than {2 * Image.MAX_IMAGE_PIXELS} pixels, which PIL "
                             f"refuses as a decompression bomb; at most {limits.max_image_pixels} (max_image_pixels)"
                             ) from None
        except Exception as e:  # PIL's many ways of saying "not an image"
            raise ImageError(f"{where}: the data is not a valid {image.format} image ({type(e).__name__})") from None
        if found != FORMATS[image.format]:
            raise ImageError(f"{where}: the data is {found or 'not an image'}, not {image.format}")
        if width * height > limits.max_image_pixels:
            raise ImageError(f"{where}: {width}x{height} is {width * height} pixels; at most "
                             f"{limits.max_image_pixels} (max_image_pixels)")
        patches = self._patches(where, width, height)
        tokens = patches // self.merge ** 2
        if image.expected_tokens is not None and image.expected_tokens != tokens:
            raise ImageError(f"{where}: expected_tokens is {image.expected_tokens}, but this model's processor makes "
                             f"{tokens} tokens of this {width}x{height} {image.format} image")
        patch = int(getattr(self.processor, "patch_size", 1))
        return SizedImage(where, image.data, image.format, width, height, patches, tokens, patches * patch * patch)

    def _patches(self, where: str, width: int, height: int) -> int:
        """The processor's patch count for a `width` x `height` image, from its own resize rules."""
        count = getattr(self.processor, "get_number_of_image_patches", None)
        if count is None:
            raise ImageError(f"{where}: this model's image processor ({type(self.processor).__name__}) cannot count an "
                             "image's tokens from its size, so its images cannot be checked before they are decoded; "
                             "this server takes images for processors that can (Qwen-VL's)")
        try:
            return int(count(height, width, images_kwargs={}))
        except ValueError as e:  # its resize rules refuse the size (Qwen-VL: an aspect ratio of 200 or more)
            raise ImageError(f"{where}: this model's image processor refuses a {width}x{height} image: {e}") from None

    def check(self, pixels: Pixels) -> None:
        """Decode each image and let the pixels go: an `ImageError` naming one whose data is cut short
        or corrupt (its header was fine), before its request is queued."""
        for image in pixels.images:
            self._open(image).close()

    def decode(self, pixels: Pixels) -> None:
        """Decode and process `pixels`' images into its `pixel_values` and `grid_thw`; an `ImageError`
        naming the image if one cannot be decoded (a truncated file) or processed."""
        values, grids = [], []
        for image in pixels.images:
            with self._lock:
                self.decoded += 1
            pixel_values, grid = self._process(image)
            if int(grid.prod()) != image.patches:  # the processor disagrees with itself: the server's fault
                raise RuntimeError(f"{image.where}: the image processor made {int(grid.prod())} patches of a "
                                   f"{image.width}x{image.height} image, and {image.patches} from its size")
            values.append(pixel_values)
            grids.append(grid)
        pixels.decoded(torch.cat(values), torch.cat(grids))

    def _open(self, image: SizedImage):
        """The image decoded by PIL, or an `ImageError` naming it."""
        from PIL import Image

        try:
            pil = Image.open(io.BytesIO(image.data))
            pil.load()
        except Exception as e:  # a truncated or corrupt file: its header was fine
            raise ImageError(f"{image.where}: the {image.format} data cannot be decoded ({type(e).__name__}: "
                             f"{str(e)[:200]})") from None
        return pil

    def _process(self, image: SizedImage) -> tuple[torch.Tensor, torch.Tensor]:
        """The image's pixel patches and its grid."""
        pil = self._open(image)
        try:
            out = self.processor(images=[_rgb(pil)], return_tensors="pt")
        except Exception as e:
            log.warning("%s: the image processor failed on a %dx%d %s image", image.where, image.width, image.height,
                        pil.mode, exc_info=True)
            raise ImageError(f"{image.where}: this model's image processor cannot use this {image.width}x"
                             f"{image.height} {pil.mode} image ({type(e).__name__}: {str(e)[:200]})") from None
        return out["pixel_values"].float(), out["image_grid_thw"].long()

    def check_count(self, n_images: int) -> None:
        if n_images > self.limits.max_images_per_request:
            raise ImageError(f"{n_images} images in one request; at most {self.limits.max_images_per_request} "
                             "(max_images_per_request)")


def _rgb(pil):
    """A decoded image as 8-bit RGB: transparency composited onto white, as a Hugging Face image
    processor converts it (transformers' `convert_to_rgb`), and 16-bit grayscale scaled to 8 bits."""
    from PIL import Image

    if pil.mode in SIXTEEN_BIT_GRAY:
        pil = Image.fromarray(np.clip(np.asarray(pil).astype(np.int64) >> 8, 0, 255).astype(np.uint8))
    if pil.mode == "RGB":
        return pil
    if "A" in pil.getbands() or pil.info.get("transparency") is not None:
        rgba = pil.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return pil.convert("RGB")


def require_pillow(model: str) -> None:
    """A `MissingPackage` saying what to install if Pillow, which images need, is not installed."""
    try:
        import PIL.Image  # noqa: F401
    except ImportError:
        raise MissingPackage(f"{model} is a vision-language model and its images need Pillow, which is not "
                             "installed: pip install pillow (./launch.sh serve installs it)") from None


def image_encoder(model: torch.nn.Module, source: str, tokenizer: Any, limits: ImageLimits) -> ImageEncoder | None:
    """The encoder of a vision-language model loaded from `source`; None for a text-only model."""
    config = model.config
    token = getattr(config, "image_token_id", None)
    if token is None or getattr(config, "vision_config", None) is None:
        return None
    require_pillow(source)
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(source, backend="pil")  # no torchvision needed
    start, end = getattr(config, "vision_start_token_id", None), getattr(config, "vision_end_token_id", None)
    wrap = None
    if start is not None and end is not None:
        wrap = "{}...{}".format(*tokenizer.convert_ids_to_tokens([int(start), int(end)]))
    name = tokenizer.convert_ids_to_tokens(int(token))
    return ImageEncoder(processor, VisionTokens(int(token), name, wrap), limits)


def no_images(where: str, model_name: str) -> ImageError:
    return ImageError(f"{where}: an image chunk, but {model_name} takes no images (a text-only model); "
                      "send text chunks only")
