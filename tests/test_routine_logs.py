"""A normal run logs no WARNING: routine decisions are INFO, once per shape (issue 41 item 7).

The fusion policy (runtime/invariance.py) decides per batch shape whether tenants' LoRA deltas
may share one batched matmul; a refusal is a routine choice of kernels, not something an
operator acts on, and a run meets hundreds of batch shapes. A real server on the embedded model
in bfloat16 (where the unembedding's grouped kernel changes bits at some shapes on CPU) trains a
few steps at several widths; its whole log has no WARNING, and each layer shape's refusal is one
INFO line.
"""

from __future__ import annotations

import re

from tinker import types

from helpers import BASE_MODEL, sft_batch
from server_process import ServerProcess

KEY = "tml-routine-logs"


def test_a_run_of_many_shapes_logs_no_warning_and_each_refusal_once(tmp_path):
    # A keys file's key: dev mode's warning (an operator's to act on) is not part of this run.
    srv = ServerProcess(tmp_path, args=("--dtype", "bfloat16"), env={"HOSTED_TINKER_API_KEYS": KEY}).start()
    try:
        with srv.client(KEY) as sc:
            tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8).result()
            for _ in range(2):  # the second round meets only shapes decided already
                for n, length in ((1, 10), (1, 40), (2, 60), (3, 30), (2, 90)):
                    tc.forward_backward(sft_batch(n, min_len=length, max_len=length + 1), "cross_entropy").result()
                    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    finally:
        srv.stop()
    log = srv.log(tail=None)
    assert not [line for line in log.splitlines() if " WARNING " in line]
    refusals = re.findall(r" (\w+) hosted_tinker\.runtime\.invariance: LoRA deltas of rank (\d+), (\d+x\d+) \((\w+)\) "
                          r"will not share a batched matmul", log)
    assert refusals, "the run met no shape the grouped kernel refuses: it shows nothing"
    assert {level for level, *_ in refusals} == {"INFO"}
    shapes = [tuple(shape) for _, *shape in refusals]
    assert len(shapes) == len(set(shapes)), shapes  # one line per layer shape, however many batch shapes
