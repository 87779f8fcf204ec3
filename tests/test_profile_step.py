"""benchmarks/profile_step.py (issue 34, part 1): the kernel profile of the fused step in one call.

The script is run as the GPU table runs it (`python3 benchmarks/profile_step.py --out DIR`), here
on the CPU preset (the embedded tiny body and a 4-expert MoE), and the files it writes are read
back: a summary of every case, each case's top-kernel table and a trace that Perfetto opens
(Chrome trace JSON with its events).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ("dense-1", "dense-16", "moe-16")


def test_the_profile_writes_every_cases_files(tmp_path):
    out = tmp_path / "profile"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_step.py"), "--out", str(out),
                          "--preset", "cpu", "--warmup", "1", "--seq-len", "16", "--threads", "1"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"] == "cpu"
    for case in CASES:
        s = summary[case]
        assert "error" not in s, s.get("traceback")
        assert s["wall_ms"] > 0 and 0 < s["busy_fraction"] <= 1, s
        assert s["top_level_aten_ops"] > 0 and s["host_syncs"] >= 1, s  # the pass's one wait at least
        assert s["top"] and s["top"][0]["count"] >= 1, s
        table = (out / case / "kernels.txt").read_text().splitlines()
        assert table[0].startswith("top ") and any("aten::" in line for line in table[3:]), table[:5]
        trace = json.loads((out / case / "trace.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert f"fused_step {case}" in names and any(n.startswith("aten::mm") for n in names), case
    ratio = summary["host_ops_tiny"]
    assert set(ratio["per_tenants"]) == {"1", "16"} and ratio["ratio_16_over_1"] > 0, ratio
    text = (out / "summary.txt").read_text()
    assert all(case in text for case in CASES), text
