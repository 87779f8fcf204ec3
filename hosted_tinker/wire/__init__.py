"""Protobuf wire format of the Tinker API: the package re-exports the codec (see codec.py).

May import models/ (an image's pixels) and the ground floor.
"""

from . import codec
from .codec import *  # noqa: F403 (its __all__)

__all__ = codec.__all__
