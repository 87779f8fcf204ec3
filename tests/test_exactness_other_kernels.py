"""The exactness tests again, under the CPU kernels of another machine (issue 10).

Co-batched results must equal solo results on any x86 CPU, not only on the one the suite runs
on. ATen, oneDNN and MKL pick their kernels by the CPU's instruction set; limiting them to AVX2
gives the kernels of an older (or another vendor's) x86 CPU -- under which, measured on an
AVX-512 Xeon, MKL's matmul rows stop being independent of the row count. This re-runs the
exactness modules in a subprocess with those settings (a server started there inherits them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
EXACTNESS_TESTS = [  # every test that compares a co-batched result with a solo one bit for bit
    "tests/test_multi_tenant_runtime.py",
    "tests/test_fusion_policy.py",
    "tests/test_rl_cobatch.py",
    "tests/test_moe_lora.py::test_cobatched_equals_solo_on_an_moe_model",
    "tests/test_moe_lora.py::test_wide_experts_share_micro_batches_wherever_their_dense_twin_does",
    "tests/test_graphs.py",
    "tests/test_multi_lora.py::test_multi_adapter_adamw_step_is_torch_adamw_and_many_equal_one",
    "tests/test_e2e_multi_tenant.py::test_eight_concurrent_clients_match_their_solo_runs",
    "tests/test_e2e_multi_tenant.py::test_isolation_bit_identical_with_or_without_a_neighbour",
    "tests/test_recompute.py::test_recomputed_layers_give_the_same_bits_and_keep_less_for_the_backward",
    "tests/test_lora_precision.py::test_bf16_tenants_cobatched_keep_their_solo_bits",
    "tests/test_lora_precision.py::test_a_split_batch_stays_within_1e_3_in_bf16",
]


@pytest.mark.e2e
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="not an x86 CPU with AVX2: there are no AVX2 kernels to select")
@pytest.mark.skipif(os.environ.get("ATEN_CPU_CAPABILITY") == "avx2", reason="already running with AVX2 kernels")
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "AVX2",
                    reason="this CPU's best kernels are AVX2 ones: the suite ran these tests on them already")
def test_exactness_tests_pass_with_avx2_kernels(tmp_path):
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, **AVX2_ONLY}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           "--basetemp", str(tmp_path / "pytest"), *EXACTNESS_TESTS],
                          cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "passed" in proc.stdout and " failed" not in proc.stdout
