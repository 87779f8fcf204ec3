"""The team server's settings (issue 36) are checked before anything slow starts: admins own keys of the
keys file, and a rate card parses and names only served models; each mistake is one line, exit 2."""

from __future__ import annotations

import pytest

from helpers import BASE_MODEL, TEAM, assert_one_line_error, serve, write_team_keys


def test_an_admin_who_owns_no_key_is_one_line(tmp_path):
    keys = write_team_keys(tmp_path / "keys")
    out = serve(tmp_path, "--api-keys-file", str(keys), "--admin-users", "root,carol")
    assert_one_line_error(out, r"--admin-users: 'carol' owns no API key \(the keys' owners: alice, bob, root\)")


def test_admins_without_keys_are_one_line(tmp_path):
    out = serve(tmp_path, "--admin-users", "root")
    assert_one_line_error(out, r"--admin-users: admins are owners of API keys, and none are configured .*")


def test_admins_from_the_environment_and_the_config_file(tmp_path):
    keys = write_team_keys(tmp_path / "keys")
    (tmp_path / "team.yaml").write_text("admin_users: [root, dave]\n")
    out = serve(tmp_path, "--api-keys-file", str(keys), "--config", str(tmp_path / "team.yaml"))
    assert_one_line_error(out, r"--admin-users: 'dave' owns no API key .*")
    out = serve(tmp_path, "--api-keys-file", str(keys), env={"HOSTED_TINKER_ADMIN_USERS": "eve"})
    assert_one_line_error(out, r"--admin-users: 'eve' owns no API key .*")


@pytest.mark.parametrize("card, pattern", [
    ("models: {'%s': {training: -1}}" % BASE_MODEL,
     r".*models\..*\.training = -1: Input should be greater than or equal to 0"),
    ("models: {'Qwen/Nope': {training: 1}}", r".*rates for 'Qwen/Nope', which this server does not serve .*"),
    ("storage_usd_per_gb: 1", r".*storage_usd_per_gb = 1: Extra inputs are not permitted"),
    ("models: [", r".*card.yaml: .*"),
    # Issue 40: these passed start-up, then every usage and storage report was a 500.
    ("models: {'*': {sampling_sample: .inf}}", r".*card.yaml: models\.\*\.sampling_sample = inf: Input should be a finite number"),
    ("storage_usd_per_gigabyte_month: 1e308",
     r".*card.yaml: storage_usd_per_gigabyte_month = '1e308': Input should be less than or equal to 1000000"),
    ("models: {'*': {training: 1.0e+308}}", r".*card.yaml: models\.\*\.training = 1e\+308: Input should be less .*"),
    ("models: {'*': {training: .nan}}", r".*card.yaml: models\.\*\.training = nan: Input should be a finite number"),
    ('{"storage_usd_per_gigabyte_month": Infinity}', r".*storage_usd_per_gigabyte_month = 'Infinity': .* finite number"),
    ("models: {'*': {training: yes}}", r".*models\.\*\.training = True: .*a rate is a number of USD, not a boolean"),
])
def test_a_bad_rate_card_is_one_line(tmp_path, card, pattern):
    (tmp_path / "card.yaml").write_text(card)
    out = serve(tmp_path, "--api-keys-file", str(write_team_keys(tmp_path / "keys", TEAM)),
                "--rate-card", str(tmp_path / "card.yaml"))
    assert_one_line_error(out, r"--rate-card " + pattern)
