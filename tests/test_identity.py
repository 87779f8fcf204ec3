"""Identity through the SDK's JWT exchange (issue 36): the server signs short-lived tokens with a key
of its own, accepts them wherever an API key is accepted, refuses expired, forged, rotated-out and
revoked ones with a 401 that says `invalid_token`, and `whoami` names each owner and the server's
organization."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import jwt
import pytest
import tinker

from helpers import BASE_MODEL, TEAM, write_team_keys
from hosted_tinker.accounts.tokens import TOKEN_KEY_FILE, user_urn
from hosted_tinker.store.secret_files import read_secret
from server_process import REPO_ROOT, ServerProcess

pytestmark = pytest.mark.e2e


def exchange(srv, key: str) -> str:
    r = httpx.post(f"{srv.base_url}/api/v1/auth/token", json={}, headers={"X-API-Key": key}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["jwt"]


def runs_with(srv, credential: str) -> httpx.Response:
    return httpx.get(f"{srv.base_url}/api/v1/training_runs", headers={"X-API-Key": credential}, timeout=60)


def assert_refused_token(r: httpx.Response, why: str) -> None:
    assert r.status_code == 401 and why in r.json()["detail"], r.text
    assert 'error="invalid_token"' in r.headers["www-authenticate"]  # the SDK re-exchanges on it


def test_whoami_names_each_owner_and_the_servers_organization(team_server):
    alice = tinker.RestClient(base_url=team_server.base_url, api_key=TEAM["alice"]).whoami().result()
    bob = tinker.RestClient(base_url=team_server.base_url, api_key=TEAM["bob"]).whoami().result()
    assert alice.user_urn == user_urn("alice") == "tml:user:alice" and bob.user_urn == "tml:user:bob"
    org = (team_server.data_dir / "organization_id").read_text().strip()
    assert alice.org_urn == bob.org_urn == f"tml:organization:{org}" and alice.email is None


def test_a_token_is_accepted_wherever_its_key_is(team_server):
    token = exchange(team_server, TEAM["alice"])
    claims = jwt.decode(token, options={"verify_signature": False})
    assert claims["exp"] - claims["iat"] == 3600 and claims["sub"] == "tml:user:alice"
    assert runs_with(team_server, token).status_code == 200
    r = httpx.get(f"{team_server.base_url}/v1/models", headers={"Authorization": f"Bearer {token}"}, timeout=60)
    assert r.status_code == 200  # the OpenAI routes too
    assert exchange(team_server, token)  # a valid token can be exchanged for a fresh one
    # The SDK trains and samples through the exchange (its client config turns it on).
    with team_server.client(TEAM["alice"]) as sc:
        sampler = sc.create_sampling_client(base_model=BASE_MODEL).result()
        sampler.sample(tinker.types.ModelInput.from_ints([1, 2, 3]), 1,
                       tinker.types.SamplingParams(max_tokens=2)).result()
        assert sc._get_session_holder().get_client_config().pjwt_auth_enabled


def test_expired_forged_and_malformed_tokens_are_refused(team_server):
    key = read_secret(team_server.data_dir / TOKEN_KEY_FILE)
    org = (team_server.data_dir / "organization_id").read_text().strip()
    valid = jwt.decode(exchange(team_server, TEAM["alice"]), options={"verify_signature": False})
    now = int(time.time())
    expired = jwt.encode({**valid, "iat": now - 7200, "exp": now - 3600}, key, algorithm="HS256")
    assert_refused_token(runs_with(team_server, expired), "it has expired")
    forged = jwt.encode({**valid, "sub": user_urn("bob")}, b"x" * 32, algorithm="HS256")
    assert_refused_token(runs_with(team_server, forged), "not signed with this server's current key")
    other_org = jwt.encode({**valid, "org_id": "org-elsewhere"}, key, algorithm="HS256")
    assert_refused_token(runs_with(team_server, other_org), "names no user of this server")
    assert_refused_token(runs_with(team_server, "eyJnot-a-token"), "invalid token")
    assert org == valid["org_id"]
    # Through the SDK: a forged token given as the credential cannot be exchanged, so nothing is sent with it.
    with pytest.raises(tinker.AuthenticationError):
        tinker.RestClient(base_url=team_server.base_url, api_key=forged).list_training_runs().result()


def test_a_rotated_key_and_a_removed_api_key_end_their_tokens(tmp_path):
    keys = write_team_keys(tmp_path / "keys")
    srv = ServerProcess(tmp_path / "srv", args=("--api-keys-file", str(keys))).start()
    try:
        rest = tinker.RestClient(base_url=srv.base_url, api_key=TEAM["alice"])
        rest.list_training_runs().result()  # holds a token from now on
        before = exchange(srv, TEAM["alice"])
        first_key = (srv.data_dir / TOKEN_KEY_FILE).read_text()
        out = subprocess.run([sys.executable, "-m", "hosted_tinker", "rotate-token-key", "--data-dir",
                              str(srv.data_dir)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "every token issued before now is refused" in out.stdout, out.stderr
        assert (srv.data_dir / TOKEN_KEY_FILE).read_text() != first_key
        assert (srv.data_dir / TOKEN_KEY_FILE).stat().st_mode & 0o777 == 0o600
        assert_refused_token(runs_with(srv, before), "not signed with this server's current key")
        rest.list_training_runs().result()  # the SDK was told invalid_token and exchanged its key again
        bob_token = exchange(srv, TEAM["bob"])
        assert runs_with(srv, bob_token).status_code == 200
        # bob's key leaves the keys file: the key and every token issued for it stop working at once.
        write_team_keys(keys, {k: v for k, v in TEAM.items() if k != "bob"})
        assert_refused_token(runs_with(srv, bob_token), "the API key it was issued for is no longer accepted")
        assert runs_with(srv, TEAM["bob"]).status_code == 401
        assert runs_with(srv, exchange(srv, TEAM["alice"])).status_code == 200
    finally:
        srv.stop()
