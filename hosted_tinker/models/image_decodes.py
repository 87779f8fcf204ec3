"""`ImageDecodes`: when and on which threads requests' images are decoded, and how many at once.

An image costs memory in three forms: as sent (PNG or JPEG bytes: at most `max_image_bytes`), as
8-bit pixels (3 bytes a pixel) and as the model's processed patches (Qwen-VL: float32, 24 bytes a
pixel of the resized image, 8 times the 8-bit pixels: a 4096 x 4096 image is 48 MiB of 8-bit
pixels and 384 MiB of patches). A request holds its images as sent from its arrival until its
pass (training) or its prefill (sampling), and as patches only from shortly before that until it
has run: a queued request costs its bytes, not its patches.

Two decodes of each image, so that neither the request's thread nor the device loop holds
anything long:

1. `check`, on the request's own thread before it is queued: PIL decodes each image in full (a
   file cut short is a 400 naming the image, as every other refusal) and lets the pixels go. It
   is the cheap part (measured on one core, a 4096 x 4096 image: PNG 0.36, JPEG 0.07 CPU-seconds).
2. Processing, on this pool's threads (`attach`, then `Pixels.ready`): asked for by the
   scheduler when the request is next for its model's cycle (cycle_prefix.py), by the sampler when
   the job would start (sampling/admission.py); the device loop plans or prefills the request
   once its images are done, and never waits for one (it is rung when one is done). It is the
   costly part: the same image takes 2.6 (JPEG) to 4.0 (PNG) CPU-seconds through Qwen3-VL's
   processor, and ~1.1 GB at its peak.

At most `max_decodes` decodes run at once on the whole server, both kinds counted, and at most
`max_decodes_per_key` of one API key's: a request whose check finds either bound reached gets
`Busy` (a 429 naming it, which the SDK retries) rather than a wait, which would hold one of the
request threads every key shares; a processing beyond them waits its turn here, the oldest first
among the keys under their own bound, so one key's flood of images cannot hold back another's.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

from .. import faults
from ..errors import Busy, UserError
from .vision import ImageEncoder, Pixels

log = logging.getLogger(__name__)


@dataclass
class _Processing:
    owner: str
    encoder: ImageEncoder
    pixels: Pixels
    wake: Callable[[], None]  # rings the device loop that waits for these pixels


class ImageDecodes:
    def __init__(self, max_decodes: int, max_decodes_per_key: int):
        self.max_decodes = max_decodes
        self.max_decodes_per_key = max_decodes_per_key
        self._cond = threading.Condition()
        self.running = 0  # decodes running now, checks and processings
        self._running_of: dict[str, int] = {}  # one entry per key decoding now
        self._waiting: deque[_Processing] = deque()
        self._threads: list[threading.Thread] = []
        self._closed = False

    @property
    def waiting(self) -> int:
        """Processings asked for and not yet started (for /metrics)."""
        return len(self._waiting)

    def check(self, owner: str, encoder: ImageEncoder, pixels: list[Pixels]) -> None:
        """Decode a request's images once, on this thread, keeping nothing (an `ImageError` naming an
        image whose data is cut short or corrupt); `Busy` if a bound is reached."""
        if not pixels:
            return
        with self._slot(owner):
            faults.gate("image.decode")
            for p in pixels:
                encoder.check(p)

    def attach(self, owner: str, encoder: ImageEncoder, pixels: list[Pixels], wake: Callable[[], None]) -> None:
        """From now on each of `pixels` is processed here when its `ready()` is first asked, and
        `wake` is rung when it is done."""
        for p in pixels:
            p.ask_decode = partial(self._ask, owner, encoder, wake)

    def close(self) -> None:
        """Stop the threads once the processings they run are done (the rest are dropped: the
        server is stopping and fails its unfinished requests)."""
        with self._cond:
            self._closed = True
            self._waiting.clear()
            self._cond.notify_all()

    # -- the slots -----------------------------------------------------------------------------------
    @contextmanager
    def _slot(self, owner: str) -> Iterator[None]:
        with self._cond:
            running = self._running_of.get(owner, 0)
            if running >= self.max_decodes_per_key:
                raise Busy(f"this API key has {running} requests decoding images now (max_image_decodes_per_key = "
                           f"{self.max_decodes_per_key}); wait for them to finish")
            if self.running >= self.max_decodes:
                raise Busy(f"the server is decoding {self.running} requests' images now (max_image_decodes = "
                           f"{self.max_decodes}); try again shortly")
            self._take(owner)
        try:
            yield
        finally:
            self._give_back(owner)

    def _take(self, owner: str) -> None:
        self.running += 1
        self._running_of[owner] = self._running_of.get(owner, 0) + 1

    def _give_back(self, owner: str) -> None:
        with self._cond:
            self.running -= 1
            self._running_of[owner] -= 1
            if not self._running_of[owner]:
                del self._running_of[owner]
            self._cond.notify_all()

    # -- processing ----------------------------------------------------------------------------------
    def _ask(self, owner: str, encoder: ImageEncoder, wake: Callable[[], None], pixels: Pixels) -> None:
        with self._cond:
            self._waiting.append(_Processing(owner, encoder, pixels, wake))
            if len(self._threads) < self.max_decodes:
                thread = threading.Thread(target=self._serve, name=f"image-decode-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._cond.notify_all()

    def _next(self) -> _Processing | None:
        """The oldest processing whose key is under its bound, once a slot is free (its slot taken);
        None once closed."""
        with self._cond:
            while not self._closed:
                if self.running < self.max_decodes:
                    for i, job in enumerate(self._waiting):
                        if self._running_of.get(job.owner, 0) < self.max_decodes_per_key:
                            del self._waiting[i]
                            self._take(job.owner)
                            return job
                self._cond.wait()
            return None

    def _serve(self) -> None:
        while (job := self._next()) is not None:
            try:
                faults.hold("image.before_processing")
                job.encoder.decode(job.pixels)
            except Exception as e:  # an `ImageError` fails its request as the user's; anything else as a bug
                if not isinstance(e, UserError):
                    log.exception("processing a request's images failed")
                job.pixels.failed(e)
            finally:
                self._give_back(job.owner)
            job.wake()
