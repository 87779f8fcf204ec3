"""A sample cut short is charged the compute it had (issue 40, item 3): a streamed `/v1/completions`
whose client goes away, and a sample that fails after its prefill, are charged their prompt and the
tokens generated until they stopped, once, as the admin's usage report (`AdminClient.get_billing_usage`)
shows them. Before, both were free.

One server for the module, with a keys file (each test its own owner), a rate card whose every rate is
the largest a card may hold (so each cost is its token count, and no report can overflow), and the
built-in sampler's `sampling.decode_poisoned` fault point armed from its 5th reach: a prompt holding
the poisoned id fails at its 5th decode step, after its prefill and 5 tokens per sample, every time.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import openai
import pytest
import tinker
from tinker import types

from helpers import BASE_MODEL, WAIT, sampling_metrics, wait_until, write_team_keys
from hosted_tinker import faults
from hosted_tinker.accounts.rate_card import MAX_RATE_USD
from server_process import ServerProcess

pytestmark = pytest.mark.e2e

KEYS = {"streamer": "tml-usage-streamer", "failer": "tml-usage-failer", "root": "tml-usage-root"}
TOKENS_BEFORE_FAILING = 5  # the first token of each sample, then 4 decode steps: the 5th fails
PROMPT = [11, 12, 13, 14, 15, 16, 17]  # not the poisoned id: the fault point never counts it


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("usage-charged")
    keys = write_team_keys(root / "keys", KEYS)
    rates = {kind: MAX_RATE_USD for kind in ("training", "sampling_prefill", "sampling_prefill_cached",
                                            "sampling_sample")}
    (root / "card.json").write_text(json.dumps({"models": {"*": rates}, "storage_usd_per_gigabyte_month": MAX_RATE_USD}))
    proc = ServerProcess(root / "srv", args=("--api-keys-file", str(keys), "--admin-users", "root",
                                             "--rate-card", str(root / "card.json")),
                         env={faults.ENV_VAR: f"sampling.decode_poisoned@{TOKENS_BEFORE_FAILING}"}).start()
    yield proc
    proc.stop()


def usage_of(srv, owner: str) -> dict[str, int]:
    """`owner`'s tokens by kind since the last hour began, as the SDK's admin call reports them."""
    start = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    admin = tinker.AdminClient(base_url=srv.base_url, api_key=KEYS["root"])
    report = admin.get_billing_usage(start, start + timedelta(hours=3)).result()
    totals: dict[str, int] = {}
    for event in report.data:
        if event.user_name == owner:
            tokens = event.event_info.token_count
            assert event.estimated_cost_usd == pytest.approx(tokens)  # the largest rate: a dollar a token
            totals[event.event_info.type] = totals.get(event.event_info.type, 0) + tokens
    return totals


def test_a_streamed_completion_whose_client_leaves_is_charged_what_it_generated(srv):
    before = sampling_metrics(srv)
    received = 0
    with openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEYS["streamer"], max_retries=0, timeout=WAIT) as oai, \
            oai.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=3000, stream=True,
                                   extra_body={"ignore_eos": True}) as stream:
        for chunk in stream:  # the client reads some tokens, then goes away
            received += len(chunk.choices[0].text) > 0
            if received == 20:
                break
    cancelled = "hosted_tinker_sampling_requests_cancelled_total"
    after = wait_until(lambda: (m := sampling_metrics(srv))[cancelled] == before[cancelled] + 1 and m,
                       "the streamed request cancelled")
    generated = int(after["hosted_tinker_sampled_tokens_total"] - before["hosted_tinker_sampled_tokens_total"])
    assert received <= generated < 3000  # cut short, after the tokens the client read
    charged = usage_of(srv, "streamer")
    assert charged == {"sampling_prefill": len(PROMPT), "sampling_sample": generated}
    assert usage_of(srv, "streamer") == charged  # once: a later report adds nothing


def test_a_sample_that_fails_after_its_prefill_is_charged_its_prefill_and_tokens(srv):
    prompt = [faults.POISONED["sampling.decode_poisoned"][0], *PROMPT]
    with srv.client(KEYS["failer"]) as sc:
        sampler = sc.create_sampling_client(base_model=BASE_MODEL).result()
        with pytest.raises(tinker.RequestFailedError, match="sampling.decode_poisoned"):
            sampler.sample(types.ModelInput.from_ints(prompt), num_samples=2,
                           sampling_params=types.SamplingParams(max_tokens=50, seed=3)).result()
    charged = usage_of(srv, "failer")
    assert charged == {"sampling_prefill": len(prompt), "sampling_sample": 2 * TOKENS_BEFORE_FAILING}
    assert usage_of(srv, "failer") == charged


def test_the_largest_rates_price_storage_finitely(srv):
    with srv.client(KEYS["failer"]) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=2).result()
        tc.save_state("priced").result()
    admin = tinker.AdminClient(base_url=srv.base_url, api_key=KEYS["root"])
    storage = admin.get_current_checkpoint_storage_usage().result()
    (group,) = storage.data
    assert storage.effective_rate_usd_per_gigabyte_month == MAX_RATE_USD
    assert group.estimated_monthly_cost_usd == pytest.approx(group.size_gigabytes * MAX_RATE_USD)
