"""The Hugging Face hub's file-download routes, for the tokenizers of the models this server serves.

`tc.get_tokenizer()` (and the cookbook's renderers) call `AutoTokenizer.from_pretrained(<base model
name>)`, which asks the hub. With `HF_ENDPOINT` pointed at this server, huggingface_hub asks here
instead, with the same requests it sends the hub:

    HEAD/GET {HF_ENDPOINT}/{repo_id}/resolve/{revision}/{filename}
    GET      {HF_ENDPOINT}/api/models/{repo_id}[/revision/{revision}]     (model info)
    GET      {HF_ENDPOINT}/api/models/{repo_id}/tree/{revision}[/{path}]  (file listing)

and caches the files as usual under HF_HOME. This works for every served model, the embedded
default (whose name exists on no hub) included, with no hub access, from any machine that can reach
the server. Only tokenizer and config files are served (no weights), for the served base models
only, without an API key: they are what anyone using the server needs, not any tenant's data.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter, Depends
from fastapi.responses import FileResponse, JSONResponse

from ..models.loading import model_directory
from ..server.core import Server
from .deps import get_server

router = APIRouter()

# What AutoTokenizer / AutoConfig read; weights and anything else are not served.
_SERVED_FILES = re.compile(
    r"^(tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)"
    r"|merges\.txt|tokenizer\.model|[\w.-]+\.tiktoken|chat_template\.(jinja|json)|config\.json"
    r"|generation_config\.json|additional_chat_templates/[\w.-]+\.jinja)$")


def _hub_error(status: int, code: str, message: str) -> JSONResponse:
    # huggingface_hub reads X-Error-Code to tell a missing file (optional files are) from a missing repo.
    return JSONResponse({"detail": message, "error": message}, status_code=status,
                        headers={"X-Error-Code": code, "X-Error-Message": message})


@lru_cache(maxsize=8)
def _files(model_dir: Path) -> tuple[str, dict[str, tuple[Path, str]]]:
    """(commit, {filename: (path, sha256)}) for the servable files of a model directory."""
    found: dict[str, tuple[Path, str]] = {}
    for path in sorted(model_dir.rglob("*")):
        name = path.relative_to(model_dir).as_posix()
        if path.is_file() and _SERVED_FILES.match(name):
            found[name] = (path, hashlib.sha256(path.read_bytes()).hexdigest())
    commit = hashlib.sha1("".join(f"{n}:{d}\n" for n, (_, d) in found.items()).encode()).hexdigest()
    return commit, found


def _lookup(server: Server, repo_id: str, revision: str):
    """(commit, files) of a served repo, or the hub's error answer."""
    if repo_id not in server.models.names:
        return _hub_error(404, "RepositoryNotFound", f"{repo_id!r} is not served here; this server serves "
                          + ", ".join(repr(n) for n in server.models.names))
    served = _files(model_directory(repo_id, Path(server.config.data_dir)).resolve())
    if revision not in ("main", served[0]):
        return _hub_error(404, "RevisionNotFound", f"revision {revision!r} of {repo_id!r} is not served here")
    return served


@router.api_route("/{repo_id:path}/resolve/{revision}/{filename:path}", methods=["GET", "HEAD"],
                  include_in_schema=False)
def resolve(repo_id: str, revision: str, filename: str, server: Server = Depends(get_server)):
    found = _lookup(server, repo_id, revision)
    if isinstance(found, JSONResponse):
        return found
    commit, files = found
    if filename not in files:
        why = "no such file" if _SERVED_FILES.match(filename) else "only tokenizer and config files are served"
        return _hub_error(404, "EntryNotFound", f"{filename!r} of {repo_id!r}: {why}")
    path, digest = files[filename]
    return FileResponse(path, headers={"X-Repo-Commit": commit, "ETag": f'"{digest}"'})


@router.get("/api/models/{repo_id:path}/tree/{revision}/{folder:path}", include_in_schema=False)
@router.get("/api/models/{repo_id:path}/tree/{revision}", include_in_schema=False)
def tree(repo_id: str, revision: str, folder: str = "", server: Server = Depends(get_server)):
    found = _lookup(server, repo_id, revision)
    if isinstance(found, JSONResponse):
        return found
    prefix = folder.strip("/") + "/" if folder.strip("/") else ""
    entries = [{"type": "file", "path": name, "size": path.stat().st_size, "oid": digest}
               for name, (path, digest) in found[1].items() if name.startswith(prefix)]
    if prefix and not entries:
        return _hub_error(404, "EntryNotFound", f"{folder!r} of {repo_id!r}: no such folder")
    return entries


@router.get("/api/models/{repo_id:path}/revision/{revision}", include_in_schema=False)
@router.get("/api/models/{repo_id:path}", include_in_schema=False)
def model_info(repo_id: str, revision: str = "main", server: Server = Depends(get_server)):
    found = _lookup(server, repo_id, revision)
    if isinstance(found, JSONResponse):
        return found
    return {"id": repo_id, "modelId": repo_id, "sha": found[0], "private": False, "tags": [],
            "siblings": [{"rfilename": name} for name in found[1]]}
