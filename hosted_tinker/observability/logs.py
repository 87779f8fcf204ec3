"""Logging for `hosted-tinker serve`: one format for the server's records and uvicorn's.

`text` writes `time LEVEL logger: message` lines; `json` writes one JSON object per record
(python-json-logger), with the access log's fields (request_id, route, status, ms, reason) as keys
of their own. uvicorn is started with `log_config=None` so that it adds no handlers of its own:
its records reach the root handler configured here.
"""

from __future__ import annotations

import logging.config
import os

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str, fmt: str) -> None:
    """Send every record (ours, uvicorn's, libraries') to stderr in one format."""
    if fmt == "json":
        # Progress bars (huggingface_hub's and transformers', read at their import) are not JSON: off.
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        formatter = {"()": "pythonjsonlogger.json.JsonFormatter",
                     "fmt": "%(asctime)s %(levelname)s %(name)s %(message)s",
                     "rename_fields": {"asctime": "time", "levelname": "level", "name": "logger"}}
    else:
        formatter = {"format": TEXT_FORMAT}
    logging.config.dictConfig({
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": formatter},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "default",
                                "stream": "ext://sys.stderr"}},
        "root": {"level": level.upper(), "handlers": ["stderr"]},
        # uvicorn's loggers keep no handlers of their own: they propagate to the root's.
        "loggers": {**{name: {"handlers": [], "propagate": True}
                       for name in ("uvicorn", "uvicorn.error", "uvicorn.access")},
                    # httpx logs every request it sends (hub look-ups, export downloads) at INFO.
                    "httpx": {"level": "WARNING"}},
    })
