"""Images in chat messages: `image_url` parts carrying a data URL, placed where the chat template
puts the model's image placeholder.

This server does not fetch images from the network: an `image_url` must be a base64 data URL of a
PNG or JPEG (`data:image/png;base64,...`). The message keeps the image as a `{"type": "image"}`
part, which a vision-language model's chat template renders as its placeholder (Qwen-VL:
`<|vision_start|><|image_pad|><|vision_end|>`); after tokenizing, each placeholder token becomes
the image's own tokens (vision.py), in the order the images were sent.
"""

from __future__ import annotations

import base64
import binascii
import re

import numpy as np
from fastapi import HTTPException

from ...server.served_models import ServedModel
from ...models.vision import ImageError, ImageIn, Pixels, no_images


def check_takes_images(served: ServedModel) -> None:
    if served.images is None:
        raise HTTPException(400, str(no_images("messages", served.name)))

_DATA_URL = re.compile(r"data:image/(png|jpeg|jpg);base64,(.*)", re.S)


def image_part(where: str, part: dict) -> tuple[str, bytes]:
    """(format, data) of an `image_url` part."""
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str):
        raise HTTPException(400, f"{where}.image_url must be an object with a 'url'")
    match = _DATA_URL.fullmatch(url)
    if match is None:
        shown = url[:40] + ("..." if len(url) > 40 else "")
        raise HTTPException(400, f"{where}.image_url.url is {shown!r}: this server does not fetch images; send a "
                                 "data URL (data:image/png;base64,... or data:image/jpeg;base64,...)")
    try:
        data = base64.b64decode(match[2], validate=True)
    except binascii.Error:
        raise HTTPException(400, f"{where}.image_url.url: the data URL is not valid base64") from None
    return ("jpeg" if match[1] == "jpg" else match[1]), data


def expand_images(served: ServedModel, tokens: list[int], images: list[tuple[str, bytes]]) -> tuple[list[int], Pixels]:
    """The rendered prompt's tokens with each image placeholder token replaced by that image's tokens."""
    encoder = served.images
    at = [i for i, t in enumerate(tokens) if t == encoder.image_token_id]
    if len(at) != len(images):
        raise HTTPException(400, f"the chat template of {served.name!r} rendered {len(at)} image placeholders for "
                                 f"{len(images)} images (text that holds {encoder.tokens.image_name} counts as one: "
                                 "send images as image_url parts only)")
    text = np.asarray([t for t in tokens if t != encoder.image_token_id], dtype=np.int64)
    try:
        encoder.check_count(len(images))
        expanded, pixels = encoder.expand("messages", text, [
            ImageIn(position - k, data, fmt) for k, (position, (fmt, data)) in enumerate(zip(at, images))])
    except ImageError as e:
        raise HTTPException(400, str(e)) from None
    return expanded.tolist(), pixels
