"""API keys (issue 6): configured keys only, owners from the keys file, dev mode, redaction."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest
from tinker import types

from helpers import BASE_MODEL, database, sft_batch
from hosted_tinker.accounts.auth import Authenticator, InvalidCredential, KeyConfigError, KeyRing, anonymous_owner, redact
from hosted_tinker.accounts.tokens import TokenSigner
from hosted_tinker.errors import Forbidden
from hosted_tinker.accounts.revoked_keys import RevokedKeys
from server_process import ServerProcess


def test_keyring_from_env_and_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team keys\nalice: tml-alice-1\n\nbob:tml-bob-1  # laptop\ntml-bare-key\n")
    ring = KeyRing.load(f, env={"HOSTED_TINKER_API_KEYS": "tml-env-a, tml-env-b"})
    assert not ring.dev_mode and len(ring) == 5
    assert ring.owner("tml-alice-1") == "alice" and ring.owner("tml-bob-1") == "bob"
    assert ring.owner("tml-bare-key") == anonymous_owner("tml-bare-key")
    assert ring.owner("tml-env-b") == anonymous_owner("tml-env-b")
    for bad in ("tml-alice-2", "tml-", "", None, "alice", "sk-tml-alice-1"):
        assert ring.owner(bad) is None
    assert "tml-alice-1" not in repr(ring.__dict__)  # only digests are held


def test_env_entries_are_parsed_like_the_keys_file():
    """`owner:key` in the environment names an owner, as in the keys file (it was one key that never matched)."""
    ring = KeyRing.load(None, env={"HOSTED_TINKER_API_KEYS": "alice:tml-alice-key, bob: tml-bob-key,tml-bare,"})
    assert len(ring) == 3
    assert ring.owner("tml-alice-key") == "alice" and ring.owner("tml-bob-key") == "bob"
    assert ring.owner("tml-bare") == anonymous_owner("tml-bare")
    assert ring.owner("alice:tml-alice-key") is None


@pytest.mark.parametrize("entry", ["alice:sk-alice", "alice:", "tml-ok, carol:tml-", "dave:tml-two words"])
def test_malformed_env_entries_are_refused_without_echoing_the_key(entry):
    with pytest.raises(KeyConfigError, match=r"\$HOSTED_TINKER_API_KEYS entry \d") as e:
        KeyRing.load(None, env={"HOSTED_TINKER_API_KEYS": entry})
    assert "sk-alice" not in str(e.value) and "words" not in str(e.value)


def test_serve_refuses_a_malformed_key_with_one_line(tmp_path):
    env = {**os.environ, "HOSTED_TINKER_API_KEYS": "alice:sk-not-tinker"}
    out = subprocess.run([sys.executable, "-m", "hosted_tinker", "serve", "--data-dir", str(tmp_path), "--port", "1"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "hosted-tinker serve: error: $HOSTED_TINKER_API_KEYS entry 1: API keys must start with 'tml-' (the SDK refuses "
        "others); expected 'owner: tml-key' or 'tml-key'"]
    assert not database(tmp_path).exists()  # refused before touching the data dir


def test_keys_file_rejects_non_tinker_keys(tmp_path):
    f = tmp_path / "keys"
    f.write_text("carol: sk-not-a-tinker-key\n")
    with pytest.raises(ValueError, match="must start with 'tml-'"):
        KeyRing.load(f, env={})


def authenticator(tmp_path, ring: KeyRing) -> Authenticator:
    return Authenticator(ring, TokenSigner(tmp_path, 3600), RevokedKeys(tmp_path / "revoked_api_keys"))


def test_an_operators_key_cannot_be_deleted_by_its_holder(tmp_path):
    """Issue 40: `DELETE /api/v1/auth/apikey/me` (tinker auth logout) of a key of the keys file or of the
    environment is refused, naming where the key lives; the key keeps working. (The keys file over HTTP:
    test_cli_commands.py.)"""
    keys = tmp_path / "keys"
    keys.write_text("alice: tml-file-alice\n")
    auth = authenticator(tmp_path, KeyRing.load(keys, env={"HOSTED_TINKER_API_KEYS": "carol: tml-env-carol"}))
    for key, where in (("tml-file-alice", "in its keys file"), ("tml-env-carol", "in $HOSTED_TINKER_API_KEYS")):
        with pytest.raises(Forbidden, match=re.escape(f"managed by the server's operator {where}")):
            auth.delete_key(key)
        assert auth.key_info(key).source in ("keys file", "$HOSTED_TINKER_API_KEYS") and auth.owner(key)
    with pytest.raises(InvalidCredential, match="not a token"):
        auth.key_info(auth.issue_token("tml-file-alice"))


def test_a_key_deleted_in_dev_mode_stays_refused_after_a_restart(tmp_path):
    auth = authenticator(tmp_path, KeyRing.load(None, env={}))
    token = auth.issue_token("tml-dev-gone")
    assert auth.delete_key("tml-dev-gone").owner == anonymous_owner("tml-dev-gone")
    restarted = authenticator(tmp_path, KeyRing.load(None, env={}))  # what the data dir holds
    for credential in ("tml-dev-gone", token):
        with pytest.raises(InvalidCredential):
            restarted.owner(credential)
    assert restarted.owner("tml-dev-kept") == anonymous_owner("tml-dev-kept")
    assert "tml-dev-gone" not in (tmp_path / "revoked_api_keys").read_text()  # its digest only


def test_dev_mode_accepts_any_tinker_key():
    ring = KeyRing.load(None, env={})
    assert ring.dev_mode
    assert ring.owner("tml-anything") == anonymous_owner("tml-anything")
    assert ring.owner("not-tml") is None


def test_redact_blanks_credentials_everywhere():
    event = {"event_data": {"request_headers": {"X-API-Key": "tml-secret", "Accept": "x"},
                            "note": ["tml-secret-2", {"Authorization": "Bearer tml-3"}]}}
    out = redact(event)
    assert "tml-" not in str(out) and out["event_data"]["request_headers"]["Accept"] == "x"


@pytest.mark.e2e
def test_server_with_configured_keys(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("alice: tml-alice-secret\n")
    srv = ServerProcess(tmp_path / "srv", env={"HOSTED_TINKER_API_KEYS": "tml-ci-key, carol:tml-carol-key"},
                        args=("--api-keys-file", str(keys))).start()
    try:
        assert "DEV MODE" not in srv.log(tail=None) and "3 API key(s) configured" in srv.log(tail=None)
        for key in ("tml-alice-secret", "tml-ci-key", "tml-carol-key"):
            sc = srv.client(key)
            tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
            tc.forward_backward(sft_batch(2), "cross_entropy").result()
            tc.optim_step(types.AdamParams()).result()
        with sqlite3.connect(database(srv.data_dir)) as db:
            owners = {row[0] for row in db.execute("SELECT owner FROM models")}
        assert owners == {"alice", anonymous_owner("tml-ci-key"), "carol"}
        for headers in ({"X-API-Key": "tml-unknown"}, {}, {"Authorization": "Bearer tml-unknown"}):
            r = httpx.post(f"{srv.base_url}/api/v1/create_session", json={"tags": []}, headers=headers, timeout=60)
            assert r.status_code == 401 and r.json()["detail"]
        # telemetry that echoes the key is stored redacted
        event = {"events": [{"event": "GENERIC_EVENT", "event_data": {"request_headers": {
            "X-API-Key": "tml-alice-secret"}}}], "session_id": "s", "platform": "Linux", "sdk_version": "0.38.0"}
        r = httpx.post(f"{srv.base_url}/api/v1/telemetry", json=event, headers={"X-API-Key": "tml-alice-secret"})
        assert r.json() == {"status": "accepted"}
        stored = (srv.data_dir / "telemetry.jsonl").read_text()
        assert "GENERIC_EVENT" in stored and "tml-alice-secret" not in stored
        assert "tml-alice-secret" not in srv.log(tail=None) and "tml-ci-key" not in srv.log(tail=None)
    finally:
        srv.stop()


@pytest.mark.e2e
def test_dev_mode_is_announced(server):
    assert "DEV MODE" in server.log_path.read_text()


def test_a_verified_token_is_decoded_once_and_still_refused_when_expired_or_rotated(tmp_path, monkeypatch):
    """The SDK sends one token on every request: its signature is checked once, not per request
    (it was ~10 % of the event loop's busy time); expiry and key rotation still refuse it at once."""
    import jwt

    from hosted_tinker.accounts.tokens import InvalidToken, rotate_token_key

    now = [time.time()]
    signer = TokenSigner(tmp_path, 60, clock=lambda: now[0])
    token = signer.issue("alice", "mark")
    decodes = []
    real_decode = jwt.decode
    monkeypatch.setattr(jwt, "decode", lambda *a, **k: decodes.append(1) or real_decode(*a, **k))
    claims = signer.verify(token)
    assert [signer.verify(token) for _ in range(5)] == [claims] * 5 and len(decodes) == 1
    now[0] += 61
    with pytest.raises(InvalidToken, match="it has expired"):
        signer.verify(token)
    now[0] -= 61
    assert signer.verify(token) == claims
    rotate_token_key(tmp_path)
    with pytest.raises(InvalidToken, match="not signed with this server's current key"):
        signer.verify(token)
    with pytest.raises(InvalidToken):  # a refusal is not kept as verified
        signer.verify(token)
