"""A training client run as its own process by test_crash_recovery.py (so it can be killed too).

    python crash_client.py BASE_URL RESUME_PATH|- START_STEP TOTAL_STEPS OUT.jsonl

Trains steps START_STEP..TOTAL_STEPS-1 (batch i is fixed by i), saving state every 2 steps,
and appends one JSON line per completed step and per acknowledged checkpoint to OUT.jsonl.
"""

import json
import sys

import tinker
from tinker import types

from helpers import BASE_MODEL, sft_batch

ADAM = types.AdamParams(learning_rate=2e-2, weight_decay=0.01)


def main() -> None:
    base_url, resume, start, total, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    with tinker.ServiceClient(base_url=base_url, api_key="tml-crash") as sc:  # closed before this process exits
        if resume == "-":
            tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=3).result()
        else:
            tc = sc.create_training_client_from_state_with_optimizer(resume).result()
        with open(out, "a") as f:
            for step in range(start, total):
                fb = tc.forward_backward(sft_batch(4, seed=500 + step), "cross_entropy")
                opt = tc.optim_step(ADAM)
                loss = fb.result().metrics["loss:sum"]
                opt.result()
                f.write(json.dumps({"step": step, "loss": loss}) + "\n")
                f.flush()
                if (step + 1) % 2 == 0:
                    path = tc.save_state(f"step-{step + 1}").result().path
                    f.write(json.dumps({"checkpoint": path, "after_step": step + 1}) + "\n")
                    f.flush()


if __name__ == "__main__":
    main()
