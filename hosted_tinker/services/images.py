"""`ImagePixelBudget`: the image pixels each API key's waiting and running requests hold, bounded by
`max_image_pixels_per_key`, and where their images are decoded (image_decodes.py).

One budget per key, shared by its training requests (`forward_backward`, `forward`) and its sample
requests (`asample`, so `compute_logprobs`, and the OpenAI routes), not one budget for each: what it
bounds is the work and the memory a key's images cost the server once its requests run (a queued
request holds its images as sent, and they are decoded only shortly before it runs), and a
training request's images cost that as a sample request's do. A request's pixels
(vision.py `SizedImage.budget_pixels`: read from the images' headers) are taken before any of its
images is decoded. A key with the bound reached gets `Busy` (a 429 with Retry-After, which the SDK
retries) until some of its requests end; one request over the whole bound alone could never get
in, so it is a `UserError` (a 400) instead. The pixels are given back when the request ends (done,
failed, cancelled or skipped); nothing is persisted, so a restart starts every key at zero (its
unfinished requests were failed then).

Where each image is decoded, and how many decodes run at once (`max_image_decodes_per_key` per
key, `max_image_decodes` on the whole server), is image_decodes.py's: a request's images are
checked on its own thread before it is queued, and processed for the model shortly before its
pass or prefill.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..errors import Busy, UserError
from ..models.image_decodes import ImageDecodes
from ..models.vision import ImageEncoder, Pixels


class ImagePixelBudget:
    def __init__(self, max_pixels_per_key: int, decodes: ImageDecodes):
        self.max_pixels_per_key = max_pixels_per_key
        self.decodes = decodes  # the server's, every served model's requests alike
        self._lock = threading.Lock()
        self.held: dict[str, int] = {}  # one entry per key with images in flight, not per key ever seen

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

    def prepare(self, owner: str, encoder: ImageEncoder, pixels: list[Pixels], wake: Callable[[], None]) -> None:
        """Check a request's images (its pixels already held) on this thread, then leave them as sent
        until its pass or prefill asks for them (`wake`: its device loop's doorbell). A refusal
        (`ImageError` naming the image, `Busy` naming a bound) checks no further."""
        self.decodes.check(owner, encoder, pixels)
        self.decodes.attach(owner, encoder, pixels, wake)
