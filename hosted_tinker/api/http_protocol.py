"""`HttpProtocol`: uvicorn's C-parser protocol (httptools), refusing a malformed request as JSON.

uvicorn parses HTTP with httptools when it is installed and with the pure-Python h11 when not;
on h11 parsing and writing were ~27 % of the event loop's busy time under one stepping client
(py-spy, issue 42). httptools is stricter than h11 about some requests (a request line it cannot
parse), and uvicorn refuses those with a plain-text 400 before the app sees them. Every other
refusal of this server is `{"detail": ...}`, which clients read, so this one is too, and it names
what the parser found wrong.
"""

from __future__ import annotations

import json
import sys

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol


class HttpProtocol(HttpToolsProtocol):
    def send_400_response(self, msg: str) -> None:
        # Called in uvicorn's `except httptools.HttpParserError` (data_received): the error is the active one.
        error = sys.exc_info()[1]
        reason = str(error) if error is not None else ""
        body = json.dumps({"detail": f"invalid HTTP request: {reason or msg}"}).encode()
        head = [STATUS_LINE[400]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body), b"connection: close\r\n",
                 b"\r\n", body]
        self.transport.write(b"".join(head))
        self.transport.close()
