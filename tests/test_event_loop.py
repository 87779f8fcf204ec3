"""SQLite stays off the event loop (issue 12): a slow disk must not stall every other request.

The server runs in this process (uvicorn in a thread) so that every use of the store can be
watched: the writer's lock and the opening of a thread's reading connection (every read asks for
it) record whether they were used on a thread running an asyncio event loop.
After start-up, driven through the real tinker and openai SDKs (training, futures, sampling,
telemetry, REST, OpenAI), no request may touch SQLite from the loop.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
import tinker
from tinker import types

from helpers import BASE_MODEL, sft_batch
from hosted_tinker.config.settings import ServerConfig
from hosted_tinker.server.core import Server
from server_process import free_port, serve_in_process

pytestmark = pytest.mark.e2e
KEY = "tml-loop-watcher"


class WatchedLock:
    """The store's writer lock, noting every acquisition made on an event-loop thread once armed; `reads`
    wraps the function that hands a thread its reading connection, noting the same of every read."""

    def __init__(self, lock):
        self._lock = lock
        self.armed = False
        self.on_loop: list[str] = []

    def _note(self) -> None:
        if self.armed:
            try:
                task = asyncio.current_task()
            except RuntimeError:  # no loop running in this thread: a worker or the scheduler thread
                task = None
            if task is not None:
                self.on_loop.append(task.get_name())

    def reads(self, reader):
        def watched_reader():
            self._note()
            return reader()
        return watched_reader

    def __enter__(self):
        self._note()
        return self._lock.__enter__()

    def __exit__(self, *exc):
        return self._lock.__exit__(*exc)


@pytest.fixture
def watched_server(tmp_path):
    config = ServerConfig(data_dir=tmp_path, port=free_port())
    srv = Server(config)
    db = srv.store.db  # every table module's
    db.lock = watched = WatchedLock(db.lock)
    db._reader = watched.reads(db._reader)
    with serve_in_process(srv, config) as url:
        watched.armed = True  # start-up (recovery) may use the store from the loop; requests may not
        yield url, watched


def test_requests_never_touch_sqlite_on_the_event_loop(watched_server):
    url, watched = watched_server
    with tinker.ServiceClient(base_url=url, api_key=KEY) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        tc.forward_backward(sft_batch(2), "cross_entropy").result()
        tc.optim_step(types.AdamParams()).result()
        path = tc.save_weights_for_sampler("watched").result().path
        sampler = sc.create_sampling_client(model_path=path).result()
        sampler.sample(types.ModelInput.from_ints([1, 2, 3]), num_samples=1,
                       sampling_params=types.SamplingParams(max_tokens=2)).result()
        rest = tinker.RestClient(base_url=url, api_key=KEY)
        assert rest.list_training_runs().result().training_runs
        with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as oai:
            assert oai.completions.create(model=path, prompt=[1, 2], max_tokens=1).choices
            assert oai.models.list().data
    assert watched.on_loop == []
