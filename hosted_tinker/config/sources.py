"""Where the server's settings (`config.ServerConfig`) are read from, and what is said when one is wrong.

Every setting `foo_bar` can be given, highest priority first, as

    --foo-bar VALUE                      on the command line (flag names as vLLM's where vLLM has the setting)
    HOSTED_TINKER_FOO_BAR=VALUE          in the environment
    foo_bar: VALUE  (or foo-bar)         in a YAML or TOML file named by --config / HOSTED_TINKER_CONFIG

A mistake is a `SettingsError`: one line per wrong value, naming where it came from (the flag, the variable
or the file) and what is expected. A setting given by its old name (`config.RENAMED`) still works, with a
line for the start-up log.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_settings import (
    BaseSettings, CliSettingsSource, PydanticBaseSettingsSource, TomlConfigSettingsSource, YamlConfigSettingsSource,
)

ENV_PREFIX = "HOSTED_TINKER_"


class SettingsError(ValueError):
    """Invalid settings: one line per mistake, each naming where the value came from and what is expected."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def cli_source(settings_cls: type[BaseSettings], parser: argparse.ArgumentParser) -> CliSettingsSource:
    """Add a flag per setting to `parser`; call the source with `parsed_args=` to read them."""
    return CliSettingsSource(settings_cls, root_parser=parser, cli_show_env_vars=True)


def settings_from_cli(settings_cls: type[BaseSettings], source: CliSettingsSource,
                      args: argparse.Namespace) -> BaseSettings:
    """Settings from the parsed flags, the environment and the config file; raises `SettingsError`."""
    try:
        return settings_cls(_cli_settings_source=source(parsed_args=args))
    except ValidationError as e:
        raise SettingsError([_explain(err, args) for err in e.errors()]) from None


def apply_renamed(settings: BaseModel, renamed: dict[str, str]) -> list[str]:
    """Each setting given by its old name (`renamed`: old -> new) sets the new one; both names at once is a
    mistake. Returns a line for the start-up log per old name used."""
    lines = []
    for old, new in renamed.items():
        value = getattr(settings, old)
        if value is None:
            continue
        if new in settings.model_fields_set:
            raise ValueError(f"{old} is the old name of {new}: give only {new}")
        setattr(settings, new, value)
        lines.append(f"{flag(old)} (${ENV_PREFIX}{old.upper()}, {old} in a config file) is deprecated "
                     f"and goes in the next release: use {flag(new)}")
    return lines


def _explain(err: dict, args: argparse.Namespace) -> str:
    field = str(err["loc"][0]) if err["loc"] else ""
    if err["type"] == "extra_forbidden":
        return f"config file: unknown setting {field!r} (see hosted-tinker serve --help for the settings)"
    env = ENV_PREFIX + field.upper()
    if getattr(args, field, None) is not None:
        # A list setting's item names the one value that is wrong; the list as a whole, all of them.
        given = err["input"] if len(err["loc"]) > 1 else getattr(args, field)
        if isinstance(given, list):
            given = " ".join(map(str, given))
        where = f"{flag(field)} {given!s}"
    elif env in os.environ:
        where = f"${env}={os.environ[env]}"
    else:
        where = f"{field} in the config file"
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "literal_error":  # pydantic's "Input should be 'a', 'b' or 'c'"
        message = "expected one of " + ", ".join(str(c) for c in err["ctx"]["expected"].replace("'", "").replace(
            " or ", ", ").split(", "))
    return f"{where}: {message}"


class ConfigFileSource(PydanticBaseSettingsSource):
    """The file named by the `config` setting (from the flag or the environment, read before this source)."""

    def get_field_value(self, field, field_name):  # required by the base class; __call__ does the work
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = self.current_state.get("config")
        if path is None:
            return {}
        path = Path(path)
        if not path.is_file():
            raise SettingsError([f"{flag('config')} {path}: no such file"])
        readers = {".yaml": YamlConfigSettingsSource, ".yml": YamlConfigSettingsSource,
                   ".toml": TomlConfigSettingsSource}
        reader = readers.get(path.suffix.lower())
        if reader is None:
            raise SettingsError([f"{flag('config')} {path}: expected a .yaml, .yml or .toml file"])
        try:
            data = reader(self.settings_cls, path)()
        except Exception as e:  # a syntax error in the file (the parser's message says where)
            raise SettingsError([f"{flag('config')} {path}: cannot parse it: {' '.join(str(e).split())}"]) from None
        return {str(k).replace("-", "_"): v for k, v in data.items()}
