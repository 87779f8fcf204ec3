"""`ImageDecodes` (hosted_tinker/models/image_decodes.py): where and how many image decodes run, with a
stand-in encoder whose processing waits on an event the test sets (no PIL, no model: what is
tested is the pool's order and bounds, not the images).

- A check on a request's thread beyond a key's bound or the server's is `Busy` naming the setting.
- A processing waits for a free slot, and one key's processings beyond its own bound let another
  key's go first; each ends ringing its requester's doorbell with the pixels decoded, or failed
  with the encoder's error.
"""

from __future__ import annotations

import threading

import pytest
import torch

from hosted_tinker.errors import Busy
from hosted_tinker.models.image_decodes import ImageDecodes
from hosted_tinker.models.vision import ImageError, Pixels

WAIT = 60.0


class HeldEncoder:
    """Processes a `Pixels` once the test lets it (`release[pixels]`), in the order it is told."""

    def __init__(self):
        self.started: list[Pixels] = []
        self.release: dict[int, threading.Event] = {}
        self.bad: set[int] = set()  # pixels whose processing fails
        self.changed = threading.Condition()

    def check(self, pixels: Pixels) -> None:
        pass

    def decode(self, pixels: Pixels) -> None:
        with self.changed:
            self.started.append(pixels)
            self.changed.notify_all()
        assert self.release.setdefault(id(pixels), threading.Event()).wait(WAIT)
        if id(pixels) in self.bad:
            raise ImageError("datum 0 image 0: this model's image processor cannot use it")
        pixels.decoded(torch.zeros(1, 1), torch.ones(1, 3, dtype=torch.long))

    def let_go(self, pixels: Pixels) -> None:
        self.release.setdefault(id(pixels), threading.Event()).set()

    def wait_started(self, n: int) -> list[Pixels]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.started) >= n, WAIT)
            return list(self.started)


def asked(decodes: ImageDecodes, encoder, owner: str, rung: threading.Event, bad: bool = False) -> Pixels:
    """A request's pixels, attached and asked for (as the scheduler asks)."""
    p = Pixels(images=[])
    if bad:
        encoder.bad.add(id(p))
    decodes.attach(owner, encoder, [p], rung.set)
    assert not p.ready() and p.waiting
    return p


def test_checks_beyond_a_bound_are_busy_naming_it():
    decodes, encoder = ImageDecodes(max_decodes=2, max_decodes_per_key=1), HeldEncoder()
    rung = threading.Event()
    held = asked(decodes, encoder, "alice", rung)  # alice's processing takes her one slot
    encoder.wait_started(1)
    with pytest.raises(Busy, match=r"1 requests decoding images now \(max_image_decodes_per_key = 1\)"):
        decodes.check("alice", encoder, [Pixels(images=[])])
    bob = asked(decodes, encoder, "bob", threading.Event())  # the server's second slot
    encoder.wait_started(2)
    with pytest.raises(Busy, match=r"decoding 2 requests' images now \(max_image_decodes = 2\)"):
        decodes.check("carol", encoder, [Pixels(images=[])])
    for p in (held, bob):
        encoder.let_go(p)
    assert rung.wait(WAIT) and held.ready() and held.pixel_values is not None
    decodes.close()


def test_a_keys_processings_beyond_its_bound_let_another_keys_go_first():
    decodes, encoder = ImageDecodes(max_decodes=2, max_decodes_per_key=1), HeldEncoder()
    alice = [asked(decodes, encoder, "alice", threading.Event()) for _ in range(3)]
    bob_rung = threading.Event()
    bob = asked(decodes, encoder, "bob", bob_rung, bad=True)
    assert encoder.wait_started(2) == [alice[0], bob]  # alice's second and third wait for her first
    encoder.let_go(bob)
    assert bob_rung.wait(WAIT) and bob.ready() and isinstance(bob.error, ImageError)
    encoder.let_go(alice[0])
    assert encoder.wait_started(3)[-1] is alice[1]
    encoder.let_go(alice[1])
    assert encoder.wait_started(4)[-1] is alice[2]
    encoder.let_go(alice[2])
    decodes.close()
