"""`TinkerPath`: the address of a checkpoint, `tinker://<run>/<kind>/<name>`.

Every `tinker://` string the server reads is parsed here and every one it writes is printed
here, so what a path may contain is decided in one place. Names and run ids are matched whole
(`fullmatch`): with `match` and `$`, a name ending in a newline passed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SCHEME = "tinker://"

# The kind segment of a path -> the SDK's `checkpoint_type` (what the REST listings say).
KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Run ids the server makes ('sess-…:train:3', 'import-…') and ids chosen on import.
_RUN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,199}")


class InvalidPath(ValueError):
    """A checkpoint address, name or run id that is not well formed (the caller's mistake: a 400)."""


def check_name(name: str, what: str = "checkpoint name") -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
        raise InvalidPath(f"invalid {what} {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
                          "starting with a letter or digit")
    return name


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_RE.fullmatch(run_id) or ".." in run_id:
        raise InvalidPath(f"invalid training run id {run_id!r}")
    return run_id


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise InvalidPath(f"invalid checkpoint kind {kind!r}: expected one of {sorted(KINDS)}")
    return kind


@dataclass(frozen=True)
class TinkerPath:
    """A validated checkpoint address; `str()` prints it, `parse()` reads it back."""

    run: str
    kind: str
    name: str

    def __post_init__(self) -> None:
        check_run_id(self.run)
        check_kind(self.kind)
        check_name(self.name)

    @classmethod
    def parse(cls, text: str) -> "TinkerPath":
        """'tinker://<run>/<kind>/<name>' -> TinkerPath, strictly."""
        shape = f"invalid checkpoint path {text!r}: expected {SCHEME}<run>/<kind>/<name>"
        if not isinstance(text, str) or not text.startswith(SCHEME):
            raise InvalidPath(shape)
        parts = text[len(SCHEME):].split("/")
        if len(parts) != 3 or not all(parts):
            raise InvalidPath(shape)
        run, kind, name = parts
        try:
            return cls(run, kind, name)
        except InvalidPath as e:
            raise InvalidPath(f"{e} in {text!r}") from None

    @classmethod
    def of_record(cls, model_id: str, checkpoint_id: str) -> "TinkerPath":
        """The path of a checkpoint record (`checkpoint_id` is '<kind>/<name>')."""
        kind, _, name = checkpoint_id.partition("/")
        return cls(model_id, kind, name)

    @property
    def checkpoint_id(self) -> str:
        """The id the SDK and the store use within a run: '<kind>/<name>'."""
        return f"{self.kind}/{self.name}"

    @property
    def checkpoint_type(self) -> str:
        return KINDS[self.kind]

    def __str__(self) -> str:
        return f"{SCHEME}{self.run}/{self.kind}/{self.name}"
