"""hosted-tinker: a self-hosted server for the Tinker training API."""

__version__ = "0.1.0"
