"""`hosted-tinker` command line: `serve` runs the server."""

from __future__ import annotations

import argparse
import logging
import sys

from .config import ServerConfig


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .api.app import create_app

    config = ServerConfig.from_args(args)
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level,
                timeout_graceful_shutdown=60)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hosted-tinker", description="Self-hosted server for the Tinker training API")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the server",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ServerConfig.add_arguments(serve)
    serve.set_defaults(func=_serve)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
