"""Issue 40, item 8: every command of the SDK's `tinker` CLI works against the server, in both output
formats (`--format table` and `--format json`), run as the real program with its own HOME: `auth login`
(a pasted key checked at `GET /api/v1/auth/apikey/me`), `status`, `whoami`, `logout` (and the logout of a
key the CLI made, `DELETE /api/v1/auth/apikey/me`), `version`, `model list`, `run list|info`, `checkpoint
list|info|publish|unpublish|set-ttl|delete|download|push-hf`, `session export-trace` and `billing
usage|checkpoint-storage`, as a key's owner, as another key, and as an admin and not.

`push-hf` uploads to a stand-in for the Hugging Face Hub (fake_hf_hub.py): no hub is reachable here.
(`tinker checkpoint download` of a training state as its owner, json: test_cli_checkpoints.py.)
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from fake_hf_hub import FakeHfHub
from helpers import BASE_MODEL, TEAM, sft_batch
from tinker_cli import as_json, cli, in_parallel

pytestmark = pytest.mark.e2e
ADAM = types.AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def world(team_server):
    """Alice's session: one trained run with training, sampler and external checkpoints."""
    tag = uuid.uuid4().hex[:8]
    with team_server.client(TEAM["alice"], display_name=f"cli walk {tag}", user_metadata={"secret": f"s-{tag}"}) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, user_metadata={"note": f"n-{tag}"}).result()
        tc.forward_backward(sft_batch(2), "cross_entropy").result()
        tc.optim_step(ADAM).result()
        paths = {name: tc.save_state(name).result().path for name in ("cli-a", "cli-b", "cli-c")}
        paths |= {name: tc.save_weights_for_sampler(name).result().path for name in ("cli-s1", "cli-s2")}
        paths["cli-ext"] = tc.save_weights_external("cli-ext").result().path
        yield {"run": tc.model_id, "session": tc.model_id.split(":")[0], "paths": paths, "tag": tag}


def rest(srv, who: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=srv.base_url, api_key=TEAM[who])


def live(srv, who: str, run: str) -> dict[str, types.Checkpoint]:
    return {c.tinker_path: c for c in rest(srv, who).list_checkpoints(run).result().checkpoints}


def test_version_and_model_list(team_server, tmp_path):
    url, alice = team_server.base_url, TEAM["alice"]
    version, version_json, table, listed, some, none = in_parallel(
        lambda: cli(url, tmp_path, "version"), lambda: cli(url, tmp_path, "-f", "json", "version"),
        lambda: cli(url, tmp_path, "model", "list", key=alice),
        lambda: cli(url, tmp_path, "-f", "json", "model", "list", key=alice),
        lambda: cli(url, tmp_path, "-f", "json", "model", "list", "TINY-QWEN", key=alice),
        lambda: cli(url, tmp_path, "model", "list", "no-such-model", key=alice, rc=1))
    assert version.stdout.strip() == version_json.stdout.strip() == f"tinker {tinker.__version__}"
    assert BASE_MODEL in table.stdout and "Yes" in table.stdout
    (model,) = as_json(listed)["models"]
    assert as_json(some)["models"] == [model] and model["max_context_length"] > 0
    assert (model["model_name"], model["trainable"], model["sampleable"]) == (BASE_MODEL, True, True)
    assert "No model name contains 'no-such-model'" in none.stderr and "tml:organization:org-" in none.stderr


def credentials(home: Path) -> dict:
    path = home / ".tinker" / "credentials.json"
    return json.loads(path.read_text()) if path.exists() else {}


def test_auth_login_status_whoami_logout(team_server, world, tmp_path):
    url = team_server.base_url
    refused = cli(url, tmp_path, "auth", "login", stdin="tml-team-nobody\n", rc=1)
    assert "Could not validate the API key" in refused.stderr and "invalid API key" in refused.stderr
    assert credentials(tmp_path) == {}

    login = cli(url, tmp_path, "-f", "json", "auth", "login", stdin=TEAM["alice"] + "\n")
    assert "Logged in as tml:user:alice (org-" in login.stdout and "Stored API key 'alice (keys file)'" in login.stdout
    stored = credentials(tmp_path)
    record = stored["keys"][stored["default"]]
    assert record["type"] == "manual" and record["key"] == TEAM["alice"] and record["name"] == "alice (keys file)"
    assert "operator" in record["note"] and record["details"]["user_details"]["email"] == "tml:user:alice"

    # Every command below runs with the stored credential alone (no TINKER_API_KEY).
    status, status_json, who, who_json, runs = in_parallel(
        lambda: cli(url, tmp_path, "auth", "status"), lambda: cli(url, tmp_path, "-f", "json", "auth", "status"),
        lambda: cli(url, tmp_path, "auth", "whoami"), lambda: cli(url, tmp_path, "-f", "json", "auth", "whoami"),
        lambda: cli(url, tmp_path, "-f", "json", "run", "list", "--limit", "0"))
    for out in (status, status_json):
        assert out.stdout.splitlines() == ["Credentials available: yes", "Tinker accessible: yes"]
    identity = as_json(who_json)
    assert identity["user_urn"] == "tml:user:alice" and identity["org_urn"].startswith("tml:organization:org-")
    assert "tml:user:alice" in who.stdout and identity["org_urn"] in who.stdout
    assert world["run"] in {r["training_run_id"] for r in as_json(runs)["runs"]}
    again = cli(url, tmp_path, "auth", "login", stdin=TEAM["alice"] + "\n", rc=1)
    assert "Already logged in" in again.stderr

    logout = cli(url, tmp_path, "auth", "logout")
    assert "Removed credential 'alice (keys file)'. The API key is still active." in logout.stdout
    assert credentials(tmp_path)["keys"] == {} and "default" not in credentials(tmp_path)
    assert "No Tinker credentials" in cli(url, tmp_path, "-f", "json", "auth", "status", rc=1).stderr
    assert "No default credential is stored" in cli(url, tmp_path, "-f", "json", "auth", "logout", rc=1).stderr
    assert httpx.get(f"{url}/api/v1/auth/apikey/me", headers={"X-API-Key": TEAM["alice"]}).status_code == 200


def store_generated_key(home: Path, key: str) -> None:
    """The credentials file an older CLI wrote when it made a key for this machine (SDK 0.38 makes none)."""
    (home / ".tinker").mkdir(parents=True, exist_ok=True)
    (home / ".tinker" / "credentials.json").write_text(json.dumps({"version": 1, "default": "cli-made", "keys": {
        "cli-made": {"type": "generated", "key": key, "name": "tinker-cli-test",
                     "details": {"org_details": {"name": "org"}, "user_details": {"email": "someone@example.com"}}}}}))


def test_logout_of_an_operators_key_is_refused_and_the_key_kept(team_server, tmp_path):
    url, bob = team_server.base_url, TEAM["bob"]
    store_generated_key(tmp_path, bob)
    out = cli(url, tmp_path, "auth", "logout", rc=1)
    assert "Could not delete the API key on the server" in out.stderr and "Removed the local credential" in out.stderr
    r = httpx.delete(f"{url}/api/v1/auth/apikey/me", headers={"X-API-Key": bob}, timeout=60)
    assert r.status_code == 403 and "managed by the server's operator in its keys file" in r.json()["detail"]
    assert httpx.get(f"{url}/api/v1/auth/apikey/me", headers={"X-API-Key": bob}, timeout=60).status_code == 200
    assert rest(team_server, "bob").list_user_checkpoints().result() is not None  # still works


def test_logout_of_a_key_the_cli_made_deletes_it_in_dev_mode(server, tmp_path):
    url, key = server.base_url, f"tml-cli-made-{uuid.uuid4().hex[:12]}"
    me = httpx.get(f"{url}/api/v1/auth/apikey/me", headers={"X-API-Key": key}, timeout=60)
    assert me.status_code == 200 and me.json()["name"].endswith("(dev mode)")
    token = httpx.post(f"{url}/api/v1/auth/token", headers={"X-API-Key": key}, timeout=60).json()["jwt"]
    store_generated_key(tmp_path, key)
    out = cli(url, tmp_path, "-f", "json", "auth", "logout")
    assert "Removed credential 'tinker-cli-test' and deleted its API key on the server." in out.stdout
    for credential, why in ((key, "it was deleted"), (token, "no longer accepted")):  # and a token issued before
        r = httpx.get(f"{url}/api/v1/training_runs", headers={"X-API-Key": credential}, timeout=60)
        assert r.status_code == 401 and why in r.json()["detail"], r.text
    assert "invalid API key: it was deleted" in cli(url, tmp_path, "auth", "login", stdin=key + "\n", rc=1).stderr
    other = httpx.get(f"{url}/api/v1/auth/apikey/me", headers={"X-API-Key": key + "-other"}, timeout=60)
    assert other.status_code == 200  # another dev key is not touched


def test_runs_and_checkpoints_as_their_owner(team_server, world, tmp_path):
    url, alice, run, p = team_server.base_url, TEAM["alice"], world["run"], world["paths"]
    runs, runs_json, info, info_json, listed, mine, mine_json, ckpt, ckpt_json = in_parallel(
        lambda: cli(url, tmp_path, "run", "list", "--limit", "0", key=alice),
        lambda: cli(url, tmp_path, "-f", "json", "run", "list", "-c", "id,owner,checkpoint", key=alice),
        lambda: cli(url, tmp_path, "run", "info", run, key=alice),
        lambda: cli(url, tmp_path, "-f", "json", "run", "info", run, key=alice),
        lambda: cli(url, tmp_path, "-f", "json", "checkpoint", "list", "--run-id", run, key=alice),
        lambda: cli(url, tmp_path, "checkpoint", "list", "--limit", "0", key=alice),
        lambda: cli(url, tmp_path, "-f", "json", "checkpoint", "list", "--limit", "0", key=alice),
        lambda: cli(url, tmp_path, "checkpoint", "info", p["cli-a"], key=alice),
        lambda: cli(url, tmp_path, "-f", "json", "checkpoint", "info", p["cli-a"], key=alice))
    assert run in runs.stdout and "Rank 4" in runs.stdout
    assert run in {r["training_run_id"] for r in as_json(runs_json)["runs"]}
    got = as_json(info_json)
    assert (got["training_run_id"], got["model_owner"], got["lora_rank"]) == (run, "alice", 4)
    assert got["user_metadata"] == {"note": f"n-{world['tag']}"} and got["last_checkpoint"]["checkpoint_id"] == \
        "weights/cli-c" and got["last_sampler_checkpoint"]["checkpoint_id"] == "sampler_weights/cli-s2"
    assert f"n-{world['tag']}" in info.stdout and "Yes (Rank 4)" in info.stdout
    assert {c["tinker_path"] for c in as_json(listed)["checkpoints"]} == set(p.values())
    assert all(path in mine.stdout for path in p.values())
    assert set(p.values()) <= {c["tinker_path"] for c in as_json(mine_json)["checkpoints"]}
    one = as_json(ckpt_json)
    assert (one["tinker_path"], one["checkpoint_type"], one["public"], one["lora_rank"]) == (
        p["cli-a"], "training", False, 4)
    assert "weights/cli-a" in ckpt.stdout and "Yes (Rank 4)" in ckpt.stdout

    cli(url, tmp_path, "checkpoint", "set-ttl", p["cli-a"], "--ttl", "7200", key=alice)
    assert live(team_server, "alice", run)[p["cli-a"]].expires_at > datetime.now(timezone.utc) + timedelta(hours=1)
    cli(url, tmp_path, "-f", "json", "checkpoint", "set-ttl", p["cli-a"], "--remove", key=alice)
    assert live(team_server, "alice", run)[p["cli-a"]].expires_at is None
    assert "Must specify either" in cli(url, tmp_path, "checkpoint", "set-ttl", p["cli-a"], key=alice, rc=1).stderr
    cli(url, tmp_path, "checkpoint", "publish", p["cli-a"], key=alice)
    assert live(team_server, "alice", run)[p["cli-a"]].public
    cli(url, tmp_path, "-f", "json", "checkpoint", "unpublish", p["cli-a"], key=alice)
    assert not live(team_server, "alice", run)[p["cli-a"]].public
    assert "already private" in cli(url, tmp_path, "checkpoint", "unpublish", p["cli-a"], key=alice, rc=1).stderr

    kept = cli(url, tmp_path, "checkpoint", "delete", p["cli-c"], key=alice, stdin="n\n")
    assert "Deletion cancelled." in kept.stdout and p["cli-c"] in live(team_server, "alice", run)
    assert "Deleted 1 checkpoint(s)" in cli(url, tmp_path, "checkpoint", "delete", p["cli-c"], "-y", key=alice).stdout
    by_run = cli(url, tmp_path, "-f", "json", "checkpoint", "delete", "--run-id", run, "--type", "sampler_weights",
                 "--after", "2000-01-01", "-y", key=alice)
    assert as_json(by_run) == {"deleted_count": 2, "failed": []}
    assert set(live(team_server, "alice", run)) == {p["cli-a"], p["cli-b"], p["cli-ext"]}


def test_another_owners_published_checkpoint(team_server, world, tmp_path):
    """Bob describes, lists and downloads Alice's published checkpoint (its public fields only), and
    can change nothing of hers."""
    url, bob, run, p = team_server.base_url, TEAM["bob"], world["run"], world["paths"]
    cli(url, tmp_path, "checkpoint", "publish", p["cli-b"], key=TEAM["alice"])
    info, info_json, run_info, run_json, listed, private = in_parallel(
        lambda: cli(url, tmp_path, "checkpoint", "info", p["cli-b"], key=bob),
        lambda: cli(url, tmp_path, "-f", "json", "checkpoint", "info", p["cli-b"], key=bob),
        lambda: cli(url, tmp_path, "run", "info", run, key=bob),
        lambda: cli(url, tmp_path, "-f", "json", "run", "info", run, key=bob),
        lambda: cli(url, tmp_path, "-f", "json", "checkpoint", "list", "--run-id", run, key=bob),
        lambda: cli(url, tmp_path, "checkpoint", "info", p["cli-a"], key=bob, rc=1))
    one = as_json(info_json)
    assert (one["tinker_path"], one["public"], one["user_metadata"], one["is_lora"], one["lora_rank"]) == (
        p["cli-b"], True, None, True, 4)
    assert "weights/cli-b" in info.stdout and "Yes (Rank 4)" in info.stdout
    seen = as_json(run_json)
    assert (seen["model_owner"], seen["user_metadata"], seen["last_sampler_checkpoint"]) == ("alice", None, None)
    assert seen["last_checkpoint"]["tinker_path"] == p["cli-b"] and seen["last_request_time"] == \
        seen["last_checkpoint"]["time"]
    assert "Metadata" not in run_info.stdout and f"n-{world['tag']}" not in run_info.stdout
    assert [c["tinker_path"] for c in as_json(listed)["checkpoints"]] == [p["cli-b"]]
    assert "Checkpoint not found" in private.stderr

    for args in (("publish", p["cli-a"]), ("unpublish", p["cli-b"]), ("set-ttl", p["cli-b"], "--ttl", "7200")):
        assert "Resource not found" in cli(url, tmp_path, "checkpoint", *args, key=bob, rc=1).stderr
    refused = as_json(cli(url, tmp_path, "-f", "json", "checkpoint", "delete", p["cli-b"], "-y", key=bob))
    assert refused["deleted_count"] == 0 and [f["tinker_path"] for f in refused["failed"]] == [p["cli-b"]]
    assert live(team_server, "alice", run)[p["cli-b"]].public

    out = cli(url, tmp_path, "checkpoint", "download", p["cli-b"], "-o", str(tmp_path / "dl"), key=bob)
    dest = tmp_path / "dl" / p["cli-b"].replace("tinker://", "").replace("/", "_")
    assert str(dest) in out.stdout and {"adapter_config.json", "adapter_model.safetensors"} <= {
        f.name for f in dest.iterdir()}


def test_download_and_push_to_the_hub(team_server, world, tmp_path):
    url, alice, ext = team_server.base_url, TEAM["alice"], world["paths"]["cli-ext"]
    got = as_json(cli(url, tmp_path, "-f", "json", "checkpoint", "download", ext, "-o", str(tmp_path / "dl"),
                      key=alice))
    dest = Path(got["destination"])
    files = {f.name: f.read_bytes() for f in dest.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(files) and got["file_size_bytes"] == sum(
        len(b) for b in files.values())
    assert "exists" in cli(url, tmp_path, "checkpoint", "download", ext, "-o", str(tmp_path / "dl"), key=alice,
                           rc=1).stderr

    hub = FakeHfHub()
    try:
        hub_env = hub.env(str(tmp_path / "hf"))
        pushed = as_json(cli(url, tmp_path, "-f", "json", "checkpoint", "push-hf", ext, "--repo", "tester/adapter",
                             "--public", key=alice, env=hub_env))
        assert pushed == {"checkpoint_path": ext, "repo_id": "tester/adapter", "public": True}
        uploaded = hub.files[("tester/adapter", "main")]
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            assert uploaded[name] == files[name], name
        assert f"tinker_path: {ext}" in uploaded["README.md"].decode() and hub.private["tester/adapter"] is False
        table = cli(url, tmp_path, "checkpoint", "push-hf", ext, key=alice, env=hub_env)  # repo named after the run
        (derived,) = [k for k in hub.files if k != ("tester/adapter", "main")]
        assert "Checkpoint Hub Upload" in table.stdout and hub.private[derived[0]] is True  # private by default
        assert derived == (f"tester/tinker-{BASE_MODEL.split('/')[-1]}-{world['run'].replace(':', '-')}",
                           "external_weights-cli-ext")
        assert hub.files[derived]["adapter_model.safetensors"] == files["adapter_model.safetensors"]
    finally:
        hub.close()


def test_session_export_trace(team_server, world, tmp_path):
    url, alice, session = team_server.base_url, TEAM["alice"], world["session"]
    bare, url_json, saved, saved_json, theirs = in_parallel(
        lambda: cli(url, tmp_path, "session", "export-trace", session, "--url-only", key=alice),
        lambda: cli(url, tmp_path, "-f", "json", "session", "export-trace", session, "--url-only", key=alice),
        lambda: cli(url, tmp_path, "session", "export-trace", session, "-o", str(tmp_path / "t1.pftrace"), key=alice),
        lambda: cli(url, tmp_path, "-f", "json", "session", "export-trace", session, "-o",
                    str(tmp_path / "t2.pftrace"), key=alice),
        lambda: cli(url, tmp_path, "session", "export-trace", session, "--url-only", key=TEAM["bob"], rc=1))
    signed = bare.stdout.strip()
    assert signed.startswith(f"{url}/api/v1/signed_traces/") and httpx.get(signed, timeout=60).status_code == 200
    assert as_json(url_json)["session_id"] == session and as_json(url_json)["url"].startswith(url)
    assert (tmp_path / "t1.pftrace").stat().st_size > 0 and "Saved to" in saved.stdout
    assert as_json(saved_json) == {"session_id": session, "destination": str(tmp_path / "t2.pftrace"),
                                   "file_size_bytes": (tmp_path / "t2.pftrace").stat().st_size}
    assert "Resource not found" in theirs.stderr


def test_billing_as_an_admin_and_not(team_server, world, tmp_path):
    url, root = team_server.base_url, TEAM["root"]
    hour = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    window = [(hour - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ"),
              (hour + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")]
    usage, usage_json, csv, storage, storage_json, refused = in_parallel(
        lambda: cli(url, tmp_path, "billing", "usage", *window, key=root),
        lambda: cli(url, tmp_path, "-f", "json", "billing", "usage", *window, key=root),
        lambda: cli(url, tmp_path, "billing", "usage", *window, "--csv", "-", key=root),
        lambda: cli(url, tmp_path, "billing", "checkpoint-storage", key=root),
        lambda: cli(url, tmp_path, "-f", "json", "billing", "checkpoint-storage", key=root),
        lambda: cli(url, tmp_path, "billing", "usage", *window, key=TEAM["alice"], rc=1))
    rows = as_json(usage_json)["data"]
    assert any(r["session_id"] == world["session"] for r in rows)
    assert "hourly usage row(s)" in usage.stdout and world["session"] in csv.stdout  # the table's cells are cut
    assert "tml:user:alice" in json.dumps(as_json(storage_json)["data"])
    assert "Current checkpoint storage" in storage.stdout
    assert "Permission denied" in refused.stderr and "admin role" in refused.stderr
