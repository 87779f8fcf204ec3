"""The SDK's `RestClient` against the server: every run / checkpoint / session method returns the
right content (not just no exception), ownership is enforced everywhere, published checkpoints are
readable by others, save_state's overwrite and user_metadata behave, external weights download
through signed URLs with a plain GET (age-encrypted when asked, so the cookbook's
`weights.download` works), and a TTL removes a checkpoint's files and record."""

from __future__ import annotations

import json
import sqlite3
import time
from datetime import datetime, timedelta, timezone

import httpx
import numpy as np
import pyrage
import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types
from tinker_cookbook import weights

from helpers import BASE_MODEL, checkpoint_dir, database, logprobs_of, read_adapter, sft_batch, wait_until
from hosted_tinker.accounts.auth import anonymous_owner
from hosted_tinker.checkpoints.paths import TinkerPath
from hosted_tinker.checkpoints.transfer import DownloadGrant, UrlSigner

pytestmark = pytest.mark.e2e
ALICE, BOB = "tml-rest-alice", "tml-rest-bob"
ADAM = types.AdamParams(learning_rate=1e-2)


def _step(tc, seed: int) -> None:
    tc.forward_backward(sft_batch(3, seed=seed), "cross_entropy").result()
    tc.optim_step(ADAM).result()


def _disk_size(server, path: str) -> int:
    return sum(f.stat().st_size for f in checkpoint_dir(server, path).iterdir())


def within(t: datetime, earliest: datetime, latest: datetime) -> bool:
    """A time the server set between two moments of this process (same clock): no bound on how
    long the request took in between."""
    return earliest <= t <= latest


@pytest.fixture(scope="module")
def world(server):
    """Alice: one session ({"team": "rest"}) with a run ({"project": "rest"}) holding two training
    states, a sampler checkpoint and external weights; plus a second run (train_mlp=False)."""
    built_from = datetime.now(timezone.utc)
    with server.client(ALICE, user_metadata={"team": "rest"}, display_name="rest tests") as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1,
                                            user_metadata={"project": "rest"}).result()
        _step(tc, 1)
        s1 = tc.save_state("s1", user_metadata={"stage": "one"}).result().path
        _step(tc, 2)
        s2 = tc.save_state("s2").result().path
        smp = tc.save_weights_for_sampler("smp").result().path
        ext = tc.save_weights_external("ext").result().path
        tc2 = sc.create_lora_training_client(base_model=BASE_MODEL, rank=2, train_mlp=False).result()
        only_attn = tc2.save_state("attn-only").result().path
        yield dict(sc=sc, tc=tc, tc2=tc2, s1=s1, s2=s2, smp=smp, ext=ext, only_attn=only_attn, built_from=built_from,
                   alice=tinker.RestClient(base_url=server.base_url, api_key=ALICE),
                   bob=tinker.RestClient(base_url=server.base_url, api_key=BOB))


def test_training_runs(server, world):
    alice, tc, tc2 = world["alice"], world["tc"], world["tc2"]
    runs = alice.list_training_runs().result()
    assert runs.cursor.total_count == 2 and runs.cursor.offset == 0 and runs.cursor.limit == 20
    assert [r.training_run_id for r in runs.training_runs] == [tc2.model_id, tc.model_id]  # newest first
    run = runs.training_runs[1]
    assert run.base_model == BASE_MODEL and run.is_lora and run.lora_rank == 4 and not run.corrupted
    assert run.model_owner == anonymous_owner(ALICE)
    assert run.user_metadata == {"project": "rest"}
    assert run.last_checkpoint.tinker_path == world["s2"] and run.last_checkpoint.checkpoint_type == "training"
    assert run.last_sampler_checkpoint.tinker_path == world["smp"]
    assert within(run.last_request_time, world["built_from"], datetime.now(timezone.utc))
    # pagination
    page = alice.list_training_runs(limit=1, offset=1).result()
    assert [r.training_run_id for r in page.training_runs] == [tc.model_id] and page.cursor.total_count == 2
    # by id and by tinker path: the same content
    assert alice.get_training_run(tc.model_id).result() == run
    assert alice.get_training_run_by_tinker_path(world["s1"]).result() == run
    other = alice.get_training_run(tc2.model_id).result()
    assert other.lora_rank == 2 and other.last_checkpoint.tinker_path == world["only_attn"]
    assert other.last_sampler_checkpoint is None
    with pytest.raises(tinker.NotFoundError):
        alice.get_training_run("no-such-run").result()


def test_checkpoint_listings_and_weights_info(server, world):
    alice, tc = world["alice"], world["tc"]
    listed = alice.list_checkpoints(tc.model_id).result().checkpoints
    by_path = {c.tinker_path: c for c in listed}
    assert [c.tinker_path for c in listed] == [world["s1"], world["s2"], world["smp"], world["ext"]]  # oldest first
    assert [c.checkpoint_id for c in listed] == ["weights/s1", "weights/s2", "sampler_weights/smp",
                                                 "external_weights/ext"]
    assert [c.checkpoint_type for c in listed] == ["training", "training", "sampler", "external"]
    for c in listed:
        assert c.size_bytes == _disk_size(server, c.tinker_path)
        assert not c.public and c.expires_at is None
    assert by_path[world["s1"]].user_metadata == {"stage": "one"}
    assert by_path[world["s2"]].user_metadata == {}
    assert by_path[world["s1"]].time < by_path[world["s2"]].time
    # training state carries the optimizer; the others are adapters only
    assert by_path[world["s1"]].size_bytes > 2 * by_path[world["smp"]].size_bytes

    mine = alice.list_user_checkpoints().result()
    assert mine.cursor.total_count == 5
    assert [c.tinker_path for c in mine.checkpoints] == [
        world["only_attn"], world["ext"], world["smp"], world["s2"], world["s1"]]  # newest first
    page = alice.list_user_checkpoints(limit=2, offset=2).result()
    assert [c.tinker_path for c in page.checkpoints] == [world["smp"], world["s2"]]
    assert (page.cursor.offset, page.cursor.limit, page.cursor.total_count) == (2, 2, 5)

    info = alice.get_weights_info_by_tinker_path(world["s1"]).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (BASE_MODEL, True, 4)
    assert (info.train_attn, info.train_mlp, info.train_unembed) == (True, True, True)
    assert info.optimizer_config.type == "adamw"
    narrow = alice.get_weights_info_by_tinker_path(world["only_attn"]).result()
    assert narrow.lora_rank == 2 and narrow.train_mlp is False and narrow.train_attn is True


def test_sessions(world):
    alice, bob, tc, tc2 = world["alice"], world["bob"], world["tc"], world["tc2"]
    session_id = tc.model_id.split(":")[0]
    assert alice.list_sessions().result().sessions == [session_id]
    got = alice.get_session(session_id).result()
    assert got.training_run_ids == [tc.model_id, tc2.model_id]
    assert got.sampler_ids == []
    assert got.user_metadata == {"team": "rest"} and got.display_name == "rest tests"
    assert bob.list_sessions().result().sessions == []
    with pytest.raises(tinker.NotFoundError):
        bob.get_session(session_id).result()


def test_others_see_nothing_until_published(server, world):
    alice, bob, tc, s1 = world["alice"], world["bob"], world["tc"], world["s1"]
    with server.client(BOB) as bob_sc:
        for call in (lambda: bob.get_training_run(tc.model_id), lambda: bob.list_checkpoints(tc.model_id),
                     lambda: bob.get_weights_info_by_tinker_path(s1),
                     lambda: bob.get_external_weights_urls(world["ext"]),
                     lambda: bob.publish_checkpoint_from_tinker_path(s1),
                     lambda: bob.set_checkpoint_ttl_from_tinker_path(s1, 7200),
                     lambda: bob.delete_checkpoint_from_tinker_path(s1),
                     lambda: bob_sc.create_training_client_from_state(s1)):
            with pytest.raises(tinker.NotFoundError):
                call().result()
        assert bob.list_training_runs(access_scope="accessible").result().training_runs == []
        assert bob.list_user_checkpoints().result().checkpoints == []

        alice.publish_checkpoint_from_tinker_path(s1).result()
        try:
            assert [c.public for c in alice.list_checkpoints(tc.model_id).result().checkpoints] == [True, False, False, False]
            with pytest.raises(tinker.BadRequestError, match="already public"):
                alice.publish_checkpoint_from_tinker_path(s1).result()
            # Bob reads the published checkpoint (and only it), and loads it: same outputs as Alice's
            assert [c.tinker_path for c in bob.list_checkpoints(tc.model_id).result().checkpoints] == [s1]
            seen = bob.get_training_run(tc.model_id, access_scope="accessible").result()
            assert seen.last_checkpoint.tinker_path == s1 and seen.last_sampler_checkpoint is None
            assert seen.user_metadata is None  # a run's metadata stays its owner's
            assert bob.get_training_run(tc.model_id).result() == seen  # named by its id: the default scope too
            assert [r.training_run_id for r in bob.list_training_runs(access_scope="accessible").result().training_runs] \
                == [tc.model_id]
            assert bob.list_training_runs().result().training_runs == []
            assert bob.get_weights_info_by_tinker_path(s1).result().lora_rank == 4
            batch = sft_batch(3, seed=9)
            theirs = logprobs_of(bob_sc.create_training_client_from_state(s1).result().forward(batch, "cross_entropy").result())
            mine = logprobs_of(world["sc"].create_training_client_from_state(s1).result().forward(batch, "cross_entropy").result())
            for a, b in zip(theirs, mine):
                np.testing.assert_array_equal(a, b)
            # ... but cannot change it
            for call in (lambda: bob.unpublish_checkpoint_from_tinker_path(s1),
                         lambda: bob.set_checkpoint_ttl_from_tinker_path(s1, 7200),
                         lambda: bob.delete_checkpoint_from_tinker_path(s1)):
                with pytest.raises(tinker.NotFoundError):
                    call().result()
        finally:
            alice.unpublish_checkpoint_from_tinker_path(s1).result()
        with pytest.raises(tinker.BadRequestError, match="already private"):
            alice.unpublish_checkpoint_from_tinker_path(s1).result()
        with pytest.raises(tinker.NotFoundError):
            bob.list_checkpoints(tc.model_id).result()


def test_ttl_set_and_cleared(world):
    alice, tc, s2 = world["alice"], world["tc"], world["s2"]

    def expires():
        return {c.tinker_path: c.expires_at for c in alice.list_checkpoints(tc.model_id).result().checkpoints}[s2]

    asked = datetime.now(timezone.utc)
    alice.set_checkpoint_ttl_from_tinker_path(s2, 7200).result()
    two_hours = timedelta(seconds=7200)
    assert within(expires(), asked + two_hours, datetime.now(timezone.utc) + two_hours)
    alice.set_checkpoint_ttl_from_tinker_path(s2, None).result()
    assert expires() is None
    for bad in (0, -5, 11 * 365 * 24 * 3600):
        with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
            alice.set_checkpoint_ttl_from_tinker_path(s2, bad).result()


def test_ttl_expiry_removes_files_and_record(server, world):
    sc, tc, alice = world["sc"], world["tc"], world["alice"]
    short = tc.save_state("short-lived", ttl_seconds=1).result().path
    later = tc.save_weights_for_sampler("later").result().path
    alice.set_checkpoint_ttl_from_tinker_path(later, 1).result()
    folders = [checkpoint_dir(server, p) for p in (short, later)]
    assert all(f.is_dir() for f in folders)
    wait_until(lambda: not any(f.exists() for f in folders), "the expiry sweep removes the files")
    with sqlite3.connect(database(server.data_dir)) as db:
        assert db.execute("SELECT COUNT(*) FROM checkpoints WHERE model_id=? AND checkpoint_id IN (?, ?)",
                          (tc.model_id, "weights/short-lived", "sampler_weights/later")).fetchone()[0] == 0
    paths = {c.tinker_path for c in alice.list_checkpoints(tc.model_id).result().checkpoints}
    assert short not in paths and later not in paths and world["s1"] in paths
    with pytest.raises(tinker.NotFoundError):
        sc.create_training_client_from_state(short).result()
    # the name is free again
    assert tc.save_state("short-lived").result().path == short


def test_delete(server, world):
    alice, tc = world["alice"], world["tc"]
    doomed = tc.save_weights_for_sampler("doomed").result().path
    assert checkpoint_dir(server, doomed).is_dir()
    alice.delete_checkpoint_from_tinker_path(doomed).result()
    assert not checkpoint_dir(server, doomed).exists()
    assert doomed not in {c.tinker_path for c in alice.list_checkpoints(tc.model_id).result().checkpoints}
    with pytest.raises(tinker.NotFoundError):
        alice.delete_checkpoint_from_tinker_path(doomed).result()
    with pytest.raises(tinker.NotFoundError):
        alice.get_weights_info_by_tinker_path(doomed).result()


def test_save_state_overwrite_semantics(server, world):
    tc, alice = world["tc"], world["alice"]
    path = tc.save_state("ow", user_metadata={"v": "1"}).result().path
    first = read_adapter(server, path)
    _step(tc, 5)
    with pytest.raises(tinker.RequestFailedError, match="already exists.*overwrite=True"):
        tc.save_state("ow").result()
    assert all((read_adapter(server, path)[k] == v).all() for k, v in first.items())  # untouched
    (before,) = [c for c in alice.list_checkpoints(tc.model_id).result().checkpoints if c.tinker_path == path]
    assert tc.save_state("ow", overwrite=True, user_metadata={"v": "2"}).result().path == path
    assert any(not (read_adapter(server, path)[k] == v).all() for k, v in first.items())  # the new weights
    after = [c for c in alice.list_checkpoints(tc.model_id).result().checkpoints if c.tinker_path == path]
    assert len(after) == 1 and after[0].time > before.time and after[0].user_metadata == {"v": "2"}
    # training continues after a refused save (it consumed its seq_id and nothing else)
    _step(tc, 6)


def test_external_weights_and_signed_urls(server, world):
    alice, tc, ext = world["alice"], world["tc"], world["ext"]
    asked = datetime.now(timezone.utc)
    got = alice.get_external_weights_urls(ext).result()
    assert set(got.urls) == {"adapter_config.json", "adapter_model.safetensors", "manifest.json"}
    an_hour = timedelta(hours=1)  # valid for an hour from the request (in whole seconds)
    assert within(got.expires, asked + an_hour - timedelta(seconds=1), datetime.now(timezone.utc) + an_hour)
    folder = checkpoint_dir(server, ext)
    for name, url in got.urls.items():
        r = httpx.get(url, timeout=30)  # no API key: the signature is the permission
        assert r.status_code == 200 and r.content == (folder / name).read_bytes()
        assert int(r.headers["content-length"]) == len(r.content)
    weights = load_file(str(folder / "adapter_model.safetensors"))
    assert all(k.startswith("base_model.model.") and ".lora_" in k for k in weights)
    assert not (folder / "optimizer.safetensors").exists()

    url = got.urls["adapter_model.safetensors"]
    for tampered in (url[:-4] + "0000", url.replace("expires=", "expires=1"), url.split("?")[0],
                     url.replace("adapter_model.safetensors?", "manifest.json?")):
        r = httpx.get(tampered, timeout=30)
        assert r.status_code == 403 and "invalid download URL" in r.json()["detail"]
    # a correctly signed URL past its expiry is 410 Gone (signed with the server's key file)
    signer = UrlSigner(server.data_dir / "url_signing.key")
    query = dict(httpx.URL(url).params)
    past = int(time.time()) - 10
    grant = DownloadGrant(TinkerPath.parse(ext), "adapter_model.safetensors", past, query["version"], query["scope"])
    r = httpx.get(url.split("?")[0], params={**query, "expires": past, "signature": signer.signature(grant)},
                  timeout=30)
    assert r.status_code == 410 and "expired" in r.json()["detail"]

    with pytest.raises(ValueError, match="external weights"):  # the SDK refuses other kinds itself...
        alice.get_external_weights_urls(world["s1"])
    r = httpx.get(f"{server.base_url}/api/v1/training_runs/{tc.model_id}/checkpoints/weights/s1/external_weights_urls",
                  headers={"X-API-Key": ALICE}, timeout=30)  # ... and so does the server
    assert r.status_code == 400 and "external weights only" in r.json()["detail"]
    # saving again under the same name replaces it; deleting it kills its URLs
    assert tc.save_weights_external("ext").result().path == ext
    alice.delete_checkpoint_from_tinker_path(ext).result()
    r = httpx.get(got.urls["adapter_config.json"], timeout=30)
    assert r.status_code == 404 and "no longer exists" in r.json()["detail"]


def test_age_encrypted_export_decrypts_to_the_plain_one(server, world):
    """Every file of an export with age recipients is encrypted to each of them (and only the
    encrypted files are on the server); decrypted, they are the plain export's files."""
    alice, tc = world["alice"], world["tc"]
    ids = [pyrage.x25519.Identity.generate() for _ in range(2)]
    enc = tc.save_weights_external("enc", age_encryption_recipients=[str(i.to_public()) for i in ids]).result().path
    plain = tc.save_weights_external("plain").result().path
    urls = alice.get_external_weights_urls(enc).result().urls
    assert set(urls) == {"adapter_config.json.age", "adapter_model.safetensors.age", "manifest.json.age"}
    assert sorted(f.name for f in checkpoint_dir(server, enc).iterdir()) == sorted(urls)
    plain_files = {f.name: f.read_bytes() for f in checkpoint_dir(server, plain).iterdir()}
    for identity in ids:
        decrypted = {name.removesuffix(".age"): pyrage.decrypt(httpx.get(url, timeout=30).content, [identity])
                     for name, url in urls.items()}
        assert decrypted["adapter_model.safetensors"] == plain_files["adapter_model.safetensors"]
        assert decrypted["adapter_config.json"] == plain_files["adapter_config.json"]
        assert set(decrypted) == set(plain_files)
    for path in (enc, plain):
        alice.delete_checkpoint_from_tinker_path(path).result()


def test_a_bad_age_recipient_is_a_400_naming_it(world):
    good = str(pyrage.x25519.Identity.generate().to_public())
    with pytest.raises(tinker.BadRequestError, match=r"age_encryption_recipients\[1\] 'age1xyz' is not an age recipient"):
        world["tc"].save_weights_external("bad", age_encryption_recipients=[good, "age1xyz"]).result()


def test_cookbook_downloads_a_training_checkpoint(server, world, tmp_path, monkeypatch):
    """`tinker_cookbook.weights.download` of a `weights/` path: it loads the checkpoint into a new
    run, exports it encrypted to a key of its own, downloads and decrypts the files, and deletes
    the export."""
    monkeypatch.setenv("TINKER_API_KEY", ALICE)
    out = weights.download(tinker_path=world["s2"], output_dir=str(tmp_path / "adapter"), base_url=server.base_url)
    got = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    want = read_adapter(server, world["s2"])
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    assert out == str(tmp_path / "adapter")
    exports = [c.tinker_path for c in world["alice"].list_user_checkpoints().result().checkpoints
               if "/external_weights/download" in c.tinker_path]
    assert exports == []  # the temporary export is gone


@pytest.mark.parametrize("method,path,needle", [
    ("DELETE", "/api/v1/training_runs/{run}/checkpoints/bogus/x", "invalid checkpoint kind"),
    ("DELETE", "/api/v1/training_runs/{run}/checkpoints/weights/a..b", "invalid checkpoint name"),
    ("DELETE", "/api/v1/training_runs/{run}/checkpoints/weights/%2E%2E", "invalid checkpoint name"),
    ("DELETE", "/api/v1/training_runs/%2E%2E/checkpoints/weights/s1", "invalid training run id"),
    ("POST", "/api/v1/training_runs/{run}/checkpoints/weights/.hidden/publish", "invalid checkpoint name"),
    ("GET", "/api/v1/training_runs/a%20b", "invalid training run id"),
    ("GET", "/api/v1/training_runs?access_scope=everyone", "invalid access_scope"),
])
def test_bad_identifiers_are_clear_400s(server, world, method, path, needle):
    r = httpx.request(method, server.base_url + path.format(run=world["tc"].model_id),
                      headers={"X-API-Key": ALICE}, timeout=30)
    assert r.status_code == 400 and needle in r.json()["detail"], r.text


@pytest.mark.parametrize("tinker_path,needle", [
    ("tinker://run/weights", "expected tinker://"),
    ("tinker://run/weights/a/b", "expected tinker://"),
    ("tinker://../weights/x", "invalid training run id"),
    ("tinker://run/checkpoints/x", "invalid checkpoint kind"),
    ("s3://run/weights/x", "expected tinker://"),
])
def test_bad_tinker_paths(world, tinker_path, needle):
    with pytest.raises(tinker.BadRequestError, match=needle):
        world["alice"].get_weights_info_by_tinker_path(tinker_path).result()


def test_wrong_kind_for_load_is_a_clear_400(world):
    sc = world["sc"]
    with pytest.raises(tinker.BadRequestError, match="with optimizer"):
        sc.create_training_client_from_state_with_optimizer(world["smp"]).result()
    external = world["tc"].save_weights_external("not-loadable").result().path
    with pytest.raises(tinker.BadRequestError, match="cannot load"):
        sc.create_training_client_from_state(external).result()


def test_signed_urls_end_with_the_version_and_the_access_they_were_made_for(server, world):
    """A URL is for one version of a checkpoint under the access its requester had: saving
    again (or deleting and saving again) ends it; unpublishing ends the URLs others got while it
    was public, but not the owner's own."""
    alice, bob, tc = world["alice"], world["bob"], world["tc"]

    def status(url: str) -> int:
        return httpx.get(url, timeout=30).status_code

    shared = tc.save_weights_external("shared").result().path
    alice.publish_checkpoint_from_tinker_path(shared).result()
    mine = alice.get_external_weights_urls(shared).result().urls["adapter_model.safetensors"]
    theirs = bob.get_external_weights_urls(shared).result().urls["adapter_model.safetensors"]
    assert status(mine) == status(theirs) == 200
    alice.unpublish_checkpoint_from_tinker_path(shared).result()
    assert status(theirs) == 404 and status(mine) == 200
    alice.publish_checkpoint_from_tinker_path(shared).result()  # public again: anyone may read this version
    assert status(theirs) == 200

    _step(tc, 11)
    assert tc.save_weights_external("shared").result().path == shared  # a new version, private again
    assert status(mine) == 404
    mine = alice.get_external_weights_urls(shared).result().urls["adapter_model.safetensors"]
    alice.delete_checkpoint_from_tinker_path(shared).result()
    assert tc.save_weights_external("shared").result().path == shared  # deleted, then saved again
    r = httpx.get(mine, timeout=30)
    assert r.status_code == 404 and "no longer exists" in r.json()["detail"]
    assert status(alice.get_external_weights_urls(shared).result().urls["adapter_model.safetensors"]) == 200


def test_names_ending_in_a_newline_are_refused(server, world):
    """Names and run ids are matched whole: `$` would match before a trailing newline."""
    tc, run = world["tc"], world["tc"].model_id
    with pytest.raises(tinker.BadRequestError, match="invalid checkpoint name"):
        tc.save_state("s1\n").result()
    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": ALICE}, timeout=30) as http:
        for method, route, needle in [
            ("DELETE", f"/api/v1/training_runs/{run}/checkpoints/weights/s1%0A", "invalid checkpoint name"),
            ("POST", f"/api/v1/training_runs/{run}/checkpoints/weights/s1%0A/publish", "invalid checkpoint name"),
            ("GET", f"/api/v1/training_runs/{run}%0A", "invalid training run id"),
            ("POST", "/api/v1/checkpoints/import?name=x%0A", "invalid checkpoint name"),
        ]:
            r = http.request(method, route, content=b"x")
            assert r.status_code == 400 and needle in r.json()["detail"], (route, r.text)
        r = http.post("/api/v1/weights_info", json={"tinker_path": world["s1"] + "\n"})
        assert r.status_code == 400 and "invalid checkpoint name" in r.json()["detail"], r.text


def test_save_ttl_is_bounded_like_set_ttl(world):
    """A save's ttl_seconds has the same 1 s - 10 years bound as set_checkpoint_ttl: a time past
    what a listing can print would make every listing of the run fail."""
    tc, alice = world["tc"], world["alice"]
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds must be between 1 and"):
        tc.save_state("far-future", ttl_seconds=10 ** 15).result()
    assert alice.list_checkpoints(tc.model_id).result().checkpoints  # still listable
    _step(tc, 12)  # and the model goes on after the refused save
