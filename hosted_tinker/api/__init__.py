"""The HTTP edge: FastAPI routes, typed pydantic bodies, and the one place a domain error
(`errors.py`) gets its status code (`app.py`).

- `training`, `sampling`, `service`, `rest`, `sessions`, `admin`, `api_keys`: the Tinker routes;
- `openai_compat/`: `/v1/*`; `hub`: the hub's file routes for `get_tokenizer()`;
- `metrics`, `ops`, `access_log`, `dashboard`: `/metrics`, `/health` and `/version`, the access
  log, `/dashboard`.

May import every floor below (services/, server/, accounts/, ...), but hands work to the device
only through the services and the typed values of requests/ and sampling/jobs.py.
"""
