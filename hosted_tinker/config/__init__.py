"""The server's settings: one pydantic-settings class, `ServerConfig` (`settings`), declared in
groups by concern, each setting also a flag and a `HOSTED_TINKER_<NAME>` variable; `sources`
reads flags, the environment and a YAML or TOML file for every setting alike.

May import models/ (the embedded model's name), store/ (its defaults) and the ground floor.
"""
