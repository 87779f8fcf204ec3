"""age encryption of exported weights (`save_weights_external(age_encryption_recipients=...)`).

An encrypted export holds every file of a plain one, each encrypted to all the recipients and
named with an `.age` suffix (what the SDK documents and `tinker_cookbook.weights.download`
decrypts). The plaintext is written to a `.tmp-` folder next to the export and removed once the
encrypted files are in place; start-up recovery removes one a crash left behind.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

import pyrage

from .format import ADAPTER_CONFIG, ADAPTER_WEIGHTS, CHECKPOINT_FILES, write_atomically

AGE_SUFFIX = ".age"
ENCRYPTED_FILES = tuple(n + AGE_SUFFIX for n in CHECKPOINT_FILES)
MAX_RECIPIENTS = 32  # age headers grow with each recipient; a real export names one or a few
MAX_RECIPIENT_CHARS = 16384  # an SSH RSA-16384 public key is about 2,800 characters

_pyrage: Any = pyrage  # the extension module ships no type information


def parse_recipients(texts: list[str]) -> list[Any]:
    """pyrage recipients for native `age1...` keys and SSH public keys; a ValueError naming the
    first one that is not a valid recipient."""
    if len(texts) > MAX_RECIPIENTS:
        raise ValueError(f"age_encryption_recipients holds {len(texts)} recipients; at most {MAX_RECIPIENTS}")
    recipients = []
    for i, text in enumerate(texts):
        shown = text[:80] + ("..." if len(text) > 80 else "")
        if len(text) > MAX_RECIPIENT_CHARS:
            raise ValueError(f"age_encryption_recipients[{i}] is {len(text)} characters; at most {MAX_RECIPIENT_CHARS}")
        kind = _pyrage.ssh if text.startswith("ssh-") else _pyrage.x25519
        try:
            recipients.append(kind.Recipient.from_str(text))
        except _pyrage.RecipientError as e:
            raise ValueError(f"age_encryption_recipients[{i}] {shown!r} is not an age recipient "
                             f"(a native 'age1...' key or an SSH public key): {e}") from None
    return recipients


def save_encrypted(out_dir: Path, write_plain: Callable[[Path], object], recipients: list[Any]) -> None:
    """`write_plain(folder)` writes a plain checkpoint folder; `out_dir` becomes its encrypted
    copy, atomically (replacing what is there)."""
    plain = out_dir.parent / f".tmp-{out_dir.name}-plain-{uuid.uuid4().hex[:8]}"
    try:
        write_plain(plain)
        write_atomically(out_dir, lambda tmp: _encrypt_each(plain, tmp, recipients), overwrite=True)
    finally:
        shutil.rmtree(plain, ignore_errors=True)


def _encrypt_each(src: Path, dst: Path, recipients: list[Any]) -> None:
    for f in sorted(src.iterdir()):
        _pyrage.encrypt_file(str(f), str(dst / (f.name + AGE_SUFFIX)), recipients)


def holds_adapter(folder: Path) -> bool:
    """Whether `folder` holds an adapter's weights and config, plain or encrypted."""
    return any(all((folder / (n + suffix)).is_file() for n in (ADAPTER_WEIGHTS, ADAPTER_CONFIG))
               for suffix in ("", AGE_SUFFIX))


def is_encrypted(folder: Path) -> bool:
    return (folder / (ADAPTER_WEIGHTS + AGE_SUFFIX)).is_file()
