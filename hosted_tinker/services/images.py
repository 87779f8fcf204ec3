"""`ImagePixelBudget`: the image pixels each API key's waiting and running requests hold, bounded by
`max_image_pixels_per_key`, and the image decodes each key runs at once, bounded by
`max_image_decodes_per_key`.

One budget per key, shared by its training requests (`forward_backward`, `forward`) and its sample
requests (`asample`, so `compute_logprobs`, and the OpenAI routes), not one budget for each: what it
bounds is the memory a key's decoded images take on the server while its requests wait and run,
and a training request's images take that memory as a sample request's do. A request's pixels
(vision.py `SizedImage.budget_pixels`: read from the images' headers) are taken before any of its
images is decoded. A key with the bound reached gets `Busy` (a 429 with Retry-After, which the SDK
retries) until some of its requests end; one request over the whole bound alone could never get
in, so it is a `UserError` (a 400) instead. The pixels are given back when the request ends (done,
failed, cancelled or skipped); nothing is persisted, so a restart starts every key at zero (its
unfinished requests were failed then).

Decoding is the CPU- and memory-heavy step (a 4096 x 4096 image: ~3 CPU-seconds and ~1.1 GB at its
peak through Qwen3-VL's processor), and it runs on the request's own thread, one of a pool every key
shares. A key decoding `max_image_decodes_per_key` requests' images already gets `Busy` too, rather
than a place in a queue: a queued request would hold one of those shared threads while it waits, so
one key's flood could leave no thread for anyone else's requests.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from .. import faults
from ..errors import Busy, UserError
from ..vision import ImageEncoder, Pixels


class ImagePixelBudget:
    def __init__(self, max_pixels_per_key: int, max_decodes_per_key: int):
        self.max_pixels_per_key = max_pixels_per_key
        self.max_decodes_per_key = max_decodes_per_key
        self._lock = threading.Lock()
        self.held: dict[str, int] = {}  # one entry per key with images in flight, not per key ever seen
        self.decoding: dict[str, int] = {}  # one entry per key decoding images now

    def check_size(self, pixels: int) -> None:
        """A `UserError` if one request's `pixels` are more than any key may hold at once."""
        if pixels > self.max_pixels_per_key:
            raise UserError(f"this request's images have {pixels} pixels together (each counted at the larger of its "
                            "size as sent and as the model's processor resizes it); one API key's requests in flight "
                            f"may hold {self.max_pixels_per_key} (max_image_pixels_per_key): send fewer or smaller "
                            "images")

    def take(self, owner: str, pixels: int) -> None:
        """Hold `pixels` for `owner` (give them back with `give_back`), or `Busy` naming the bound."""
        with self._lock:
            held = self.held.get(owner, 0)
            if held + pixels > self.max_pixels_per_key:
                raise Busy(f"this API key has requests with {held} image pixels in flight and this one has "
                           f"{pixels} more (max_image_pixels_per_key = {self.max_pixels_per_key}); wait for "
                           "some to finish")
            if pixels:
                self.held[owner] = held + pixels

    def give_back(self, owner: str, pixels: int) -> None:
        if not pixels:
            return
        with self._lock:
            self.held[owner] -= pixels
            if not self.held[owner]:
                del self.held[owner]

    def decode(self, owner: str, encoder: ImageEncoder, pixels: list[Pixels]) -> None:
        """Decode a request's images (its pixels already held) in one of `owner`'s decode slots, or
        `Busy` if the key has none free. A refusal (`ImageError`, naming the image) decodes no further."""
        if not pixels:
            return
        with self._decode_slot(owner):
            faults.gate("image.decode")
            for p in pixels:
                encoder.decode(p)

    @contextmanager
    def _decode_slot(self, owner: str) -> Iterator[None]:
        with self._lock:
            running = self.decoding.get(owner, 0)
            if running >= self.max_decodes_per_key:
                raise Busy(f"this API key has {running} requests decoding images now (max_image_decodes_per_key = "
                           f"{self.max_decodes_per_key}); wait for them to finish")
            self.decoding[owner] = running + 1
        try:
            yield
        finally:
            with self._lock:
                self.decoding[owner] -= 1
                if not self.decoding[owner]:
                    del self.decoding[owner]
