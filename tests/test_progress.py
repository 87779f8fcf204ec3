"""Progress of long work: the base model's load stages in the server log, and byte progress of
checkpoint export (download or copy) and import (upload) through the `progress` callback that the
`hosted-tinker export` / `import` commands draw as a bar."""

from __future__ import annotations

from tinker import types

from hosted_tinker.checkpoints.export import export_checkpoint, import_adapter
from helpers import BASE_MODEL, sft_batch

import pytest

pytestmark = pytest.mark.e2e
KEY = "tml-progress"


def test_model_load_stages_are_logged(server):
    log = server.log_path.read_text()
    stages = ["loading base model hosted-tinker/tiny-qwen3-embedded from ", "loading base model: tokenizer ready",
              "base model hosted-tinker/tiny-qwen3-embedded ready: "]
    positions = [log.index(s) for s in stages]
    assert positions == sorted(positions)


def test_export_and_import_report_byte_progress_to_the_end(server, tmp_path):
    with server.client(KEY) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        tc.forward_backward(sft_batch(2), "cross_entropy").result()
        tc.optim_step(types.AdamParams()).result()
        path = tc.save_state("progress").result().path

    for name, source in (("remote", {"base_url": server.base_url, "api_key": KEY}),
                         ("local", {"data_dir": server.data_dir})):
        seen: list[tuple[int, int | None]] = []
        out = export_checkpoint(path, tmp_path / name, progress=lambda done, total: seen.append((done, total)),
                                **source)
        size = sum(f.stat().st_size for f in out.iterdir())
        assert seen and [d for d, _ in seen] == sorted(d for d, _ in seen), name
        assert seen[-1][0] >= size and seen[-1][1] in (None, seen[-1][0]), name

    sent: list[tuple[int, int | None]] = []
    answer = import_adapter(tmp_path / "local", name="progress-copy", base_url=server.base_url, api_key=KEY,
                            progress=lambda done, total: sent.append((done, total)))
    assert answer["tinker_path"].endswith("/weights/progress-copy")
    assert sent[-1][0] == sent[-1][1] and sent[-1][0] > size  # the whole archive went, with its tar headers
