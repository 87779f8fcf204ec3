"""A stand-in for the Hugging Face Hub's upload API, for `tinker checkpoint push-hf` (the machines that run
the tests reach no hub). It answers what huggingface_hub's `HfApi.whoami`, `create_repo`, `hf_hub_download`
and `upload_folder` send, with every file uploaded inline ("regular" mode, base64 in the commit), and
keeps what was committed: `hub.files[(repo_id, revision)]` is {path: bytes}.

A mock of a third party, not of this project: the server and the CLI under test are the real ones.
"""

from __future__ import annotations

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = "hf_fake_token_for_tests"


class FakeHfHub:
    def __init__(self):
        self.files: dict[tuple[str, str], dict[str, bytes]] = {}
        self.private: dict[str, bool] = {}
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _answer(self, status: int, body: dict | None = None, headers: dict | None = None):
                data = json.dumps(body if body is not None else {}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def do_GET(self):
                if self.path.startswith("/api/whoami-v2"):
                    if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                        return self._answer(401, {"error": "Invalid credentials"})
                    return self._answer(200, {"type": "user", "name": "tester", "auth": {"type": "access_token"}})
                # /{repo}/resolve/{revision}/{file}: nothing is there before the first upload
                return self._answer(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})

            do_HEAD = do_GET

            def do_POST(self):
                body = self._body()
                if self.path == "/api/validate-yaml":  # a README's front matter, checked before the upload
                    return self._answer(200, {"errors": [], "warnings": []})
                if self.path == "/api/repos/create":
                    spec = json.loads(body)
                    repo_id = f"{spec.get('organization') or 'tester'}/{spec['name']}"
                    hub.private[repo_id] = spec.get("visibility") == "private"
                    return self._answer(200, {"url": f"http://{self.headers['Host']}/{repo_id}"})
                m = re.fullmatch(r"/api/models/(.+)/(preupload|commit)/([^/?]+)(\?.*)?", self.path)
                if m is None:
                    return self._answer(404, {"error": f"no route {self.path}"})
                repo_id, what, revision = m.group(1), m.group(2), m.group(3)
                if "/" not in repo_id:  # a bare name is in the caller's own namespace, as on the hub
                    repo_id = f"tester/{repo_id}"
                if what == "preupload":
                    files = json.loads(body)["files"]
                    return self._answer(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                         "shouldIgnore": False} for f in files]})
                committed = hub.files.setdefault((repo_id, revision), {})
                for line in body.decode().splitlines():
                    op = json.loads(line)
                    if op["key"] == "file":
                        committed[op["value"]["path"]] = base64.b64decode(op["value"]["content"])
                return self._answer(200, {"commitUrl": f"http://{self.headers['Host']}/{repo_id}/commit/{'0' * 40}",
                                          "commitOid": "0" * 40})

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def env(self, hf_home: str) -> dict:
        """What the CLI's environment needs to push here (and nowhere else)."""
        return {"HF_ENDPOINT": self.endpoint, "HF_TOKEN": TOKEN, "HF_HOME": hf_home, "HF_HUB_DISABLE_XET": "1",
                "HF_HUB_OFFLINE": "0"}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
