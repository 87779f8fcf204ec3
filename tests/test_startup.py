"""Start-up: every mistake is one line with the fix, found before anything slow (issue 15).

Each case runs the real `hosted-tinker serve` and asserts its whole stderr is the one message, that
it exits with 2 (argparse's usage-error status), and that nothing slow ran first: the model was not
built or loaded, and for settings mistakes the data directory was not even created. Settings come
from flags, HOSTED_TINKER_* variables and a --config file (YAML or TOML), in that priority.
"""

from __future__ import annotations

import asyncio
import os
import re
import resource
import signal
import socket
import subprocess
import sys

import pytest
from pydantic import ValidationError
import torch

from helpers import assert_one_line_error, database, serve
from hosted_tinker.config.settings import ServerConfig
from hosted_tinker.config.sources import flag
from hosted_tinker.models.loading import DTYPES
from hosted_tinker.sampling.vllm_sidecar import vllm_child_devices
from hosted_tinker.server.startup import bind_port
from server_process import ServerProcess

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("args, env, pattern", [
    (("--dtype", "fp16"), {}, r"--dtype fp16: expected one of auto, float32, float, bfloat16, float16, half"),
    (("--log-level", "verbose"), {}, r"--log-level verbose: expected one of debug, info, warning, error, critical"),
    (("--port", "70000"), {}, r"--port 70000: .*65535"),
    (("--activation-checkpointing", "maybe"), {}, r"--activation-checkpointing maybe: expected one of auto, on, off"),
    (("--device", "gpu"), {}, r"--device gpu: 'gpu' is not a device: use auto, cpu, cuda, cuda:N, mps or xpu"),
    ((), {"HOSTED_TINKER_DTYPE": "fp8"}, r"\$HOSTED_TINKER_DTYPE=fp8: expected one of .*"),
    ((), {"HOSTED_TINKER_MAX_LORA_RANK": "many"}, r"\$HOSTED_TINKER_MAX_LORA_RANK=many: .*integer.*"),
    (("--vllm-python", "/opt/vllm/bin/python"), {},
     r"--vllm-python /opt/vllm/bin/python: only with --vllm \(it says how to launch vLLM\)"),
    (("--vllm-devices", "1"), {}, r"--vllm-devices 1: only with --vllm \(it says how to launch vLLM\)"),
    (("--vllm", "--vllm-devices", "1;2"), {},
     r"--vllm-devices 1;2: '1;2' is not a list of CUDA device numbers: use e.g. 1 or 1,2"),
    (("--vllm", "--vllm-url", "http://127.0.0.1:8001"), {},
     r"--vllm-url http://127.0.0.1:8001: give --vllm \(launch vLLM\) or --vllm-url \(attach to a running one\), "
     r"not both"),
    # Issue 40: an infinite window or timeout passed start-up, then overflowed the device loop's wait.
    (("--gather-window-s", "inf"), {}, r"--gather-window-s inf: Input should be a finite number"),
    ((), {"HOSTED_TINKER_GAP_TIMEOUT_S": "1e999"}, r"\$HOSTED_TINKER_GAP_TIMEOUT_S=1e999: Input should be a finite number"),
    (("--vllm-url", "127.0.0.1:8001"), {},
     r"--vllm-url 127.0.0.1:8001: '127.0.0.1:8001' is not an http\(s\) URL: use e.g. http://127.0.0.1:8001"),
])
def test_a_bad_setting_is_one_line_before_anything_starts(tmp_path, args, env, pattern):
    out = serve(tmp_path, *args, env=env)
    assert_one_line_error(out, pattern)
    assert not (tmp_path / "data").exists()  # not even the data directory


def test_every_mistake_gets_its_own_line(tmp_path):
    out = serve(tmp_path, "--dtype", "fp16", "--log-level", "verbose")
    assert out.returncode == 2
    assert [line.split(":")[2].strip() for line in out.stderr.splitlines()] == ["--dtype fp16", "--log-level verbose"]


def test_help_lists_every_setting_dtype_and_env_var():
    out = subprocess.run([sys.executable, "-m", "hosted_tinker", "serve", "--help"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "COLUMNS": "400"})
    assert out.returncode == 0
    text = " ".join(out.stdout.split())  # a description longer than COLUMNS wraps, its env tag too
    for name, field in ServerConfig.model_fields.items():
        assert flag(name) in text and f"[env: HOSTED_TINKER_{name.upper()}]" in text, name
        assert field.description, f"{name} has no description: --help says nothing of what it is"
    assert "{" + ",".join(["auto", *DTYPES]) + "}" in out.stdout  # every accepted dtype, aliases included
    assert "--base-model MODEL[@DEVICE], --model MODEL[@DEVICE]" in out.stdout  # vLLM's name for it too


def test_config_file_env_and_flags_combine_in_priority_order(tmp_path):
    """file < environment < flag; the start-up summary shows the values that won. The training-run
    bound is given by its old name (max_models_per_key), which still works and is logged as deprecated."""
    config = tmp_path / "server.yaml"
    config.write_text("max-lora-rank: 8\nmax_models_per_key: 3\nmax_num_samples: 5\nactivation_checkpointing: on\n")
    srv = ServerProcess(tmp_path / "srv", args=("--config", str(config), "--max-num-samples", "7"),
                        env={"HOSTED_TINKER_MAX_MODELS_PER_KEY": "4"})
    srv.start()
    try:
        log = srv.log(tail=None)
    finally:
        srv.stop()
    summary = log[log.index("hosted-tinker 0.1.0 ready"):]
    assert f"ready at http://127.0.0.1:{srv.port}" in summary
    assert re.search(rf"data dir +{re.escape(str(srv.data_dir.resolve()))}\n", summary)
    assert re.search(rf"database +{re.escape(str(database(srv.data_dir).resolve()))}\n", summary)
    assert re.search(r"model +hosted-tinker/tiny-qwen3-embedded on cpu \(float32, ", summary)
    assert "auth       DEV MODE" in summary
    assert "LoRA rank <= 8; per key 4 live training runs" in summary and "7 samples per request" in summary
    assert ("--max-models-per-key ($HOSTED_TINKER_MAX_MODELS_PER_KEY, max_models_per_key in a config file) is "
            "deprecated and goes in the next release: use --max-training-runs-per-key") in log
    assert "activation checkpointing on (set to on)" in summary


def test_a_renamed_setting_given_by_both_names_is_refused():
    with pytest.raises(ValidationError, match="max_models_per_key is the old name of max_training_runs_per_key: "
                                              "give only max_training_runs_per_key"):
        ServerConfig(max_models_per_key=3, max_training_runs_per_key=4)
    assert ServerConfig(max_models_per_key=3).max_training_runs_per_key == 3
    assert ServerConfig().deprecations == [] and ServerConfig().max_training_runs_per_key == 64


def test_a_toml_config_file_with_an_unknown_setting_is_refused(tmp_path):
    config = tmp_path / "server.toml"
    config.write_text("port = 8001\nmax_lora_rnak = 8\n")
    assert_one_line_error(serve(tmp_path, "--config", str(config)),
                          r"config file: unknown setting 'max_lora_rnak' \(see hosted-tinker serve --help .*\)")


def test_a_port_in_use_is_found_before_the_model_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = serve(tmp_path, "--port", str(port))
    assert_one_line_error(out, rf"--port {port}: 127.0.0.1:{port} is already in use by another process; stop it or "
                               r"choose another port with --port")
    assert not (tmp_path / "data" / "models").exists()  # the embedded model was not built


@pytest.mark.parametrize("model, env, pattern", [
    ("Qwen/Qwen3-8B", {"HF_HUB_OFFLINE": "1"},
     r"--base-model Qwen/Qwen3-8B: not in the Hugging Face cache \(.*\) and HF_HUB_OFFLINE is set: download it .*"),
    # A hub that cannot be reached is reported at once (no retries), whatever the reason.
    ("Qwen/Qwen3-8B", {"HF_ENDPOINT": "http://127.0.0.1:9"},
     r"--base-model Qwen/Qwen3-8B: not in the Hugging Face cache \(.*\) and http://127.0.0.1:9 cannot be reached "
     r"\(ConnectError\): download it .*"),
    ("./no/such/model", {}, r"--base-model ./no/such/model: no such directory"),
    ("not a model id!", {}, r"--base-model not a model id!: neither a local directory nor a Hugging Face model id .*"),
])
def test_a_missing_model_is_one_line_before_anything_loads(tmp_path, model, env, pattern):
    out = serve(tmp_path, "--base-model", model, env=env)
    assert_one_line_error(out, pattern)


@pytest.mark.parametrize("args, pattern", [
    (("--base-model", "./no/such/model"), r"--base-model ./no/such/model: no such directory"),
    (("--vllm", "--max-lora-rank", "1024"), r"--max-lora-rank 1024: vLLM serves LoRA ranks up to 512; lower it .*"),
])
def test_a_start_refused_by_a_check_imports_neither_torch_nor_transformers(tmp_path, args, pattern):
    """The checks before the model loads need neither (they were ~3 CPU-s of imports before each
    refusal): the summary, the vLLM sidecar's launch and the vision check import what they use."""
    out = serve(tmp_path, *args, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert_one_line_error(out, pattern)
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "hosted_tinker.server.startup" in imported and not {"torch", "transformers"} & imported


def test_a_vision_language_model_without_pillow_is_one_line_before_it_loads(tmp_path):
    """A vision-language model's images need Pillow: where it is missing (here a stand-in `PIL` that
    fails to import, first on the path), serve says what to install in one line before the model
    loads. It was an empty `ImportError:` traceback from the image processor, after the load."""
    from tiny_vl_model import build_tiny_vl_model

    model = build_tiny_vl_model(tmp_path / "tiny-qwen3-vl")
    stand_in = tmp_path / "without-pillow" / "PIL"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text("raise ImportError(\"No module named 'PIL'\")\n")
    out = serve(tmp_path, "--base-model", str(model), env={"PYTHONPATH": str(stand_in.parent)})
    assert_one_line_error(out, f"{re.escape(str(model))} is a vision-language model and its images need Pillow, which "
                               r"is not installed: pip install pillow \(./launch.sh serve installs it\)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_device_this_machine_lacks_is_one_line(tmp_path):
    assert_one_line_error(serve(tmp_path, "--device", "cuda"),
                          r"--device cuda: no cuda device is available to torch on this machine; use --device cpu "
                          r"\(or auto\)")
    assert not (tmp_path / "data").exists()


def test_an_unreadable_keys_file_is_one_line(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("alice: not-a-tinker-key\n")
    assert_one_line_error(serve(tmp_path, "--api-keys-file", str(keys)),
                          rf"--api-keys-file: {re.escape(str(keys))}:1: API keys must start with 'tml-' .*")


def _no_file_may_grow_past_4_kib():
    # A real write failure without root or a small filesystem: past the limit write() fails with EFBIG
    # (SIGXFSZ ignored), which SQLite reports exactly as it reports a full disk ("disk I/O error").
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


def test_a_database_that_cannot_be_written_is_one_line_naming_file_and_free_space(tmp_path):
    out = serve(tmp_path, preexec_fn=_no_file_may_grow_past_4_kib)
    assert_one_line_error(out, rf"cannot open the database {re.escape(str(database(tmp_path / 'data')))}: "
                               r"disk I/O error \([\d,]+ MiB free there; a full disk or a file-size limit gives this "
                               r"error\)")


@pytest.mark.parametrize("args, pattern", [
    (("--vllm", "--vllm-python", "/no/such/python"),
     r"--vllm-python /no/such/python is not an executable file; create vLLM's virtualenv .* and pass its python "
     r"with --vllm-python"),
    # An interpreter without vLLM (ours: the server's own packages are not vLLM's).
    (("--vllm", "--vllm-python", sys.executable),
     rf"--vllm-python {re.escape(sys.executable)} has no vllm package installed; install vLLM into that "
     r"virtualenv .*"),
    (("--vllm",), r"--vllm: no --vllm-python given and the default .venv-vllm/bin/python is not an executable file; .*"),
    (("--vllm", "--max-lora-rank", "1024"), r"--max-lora-rank 1024: vLLM serves LoRA ranks up to 512; lower it .*"),
    (("--vllm", "--device", "cpu", "--vllm-devices", "99"),
     r"--vllm-devices 99: (no CUDA device is available on this machine; leave --vllm-devices unset .*|"
     r"this machine has \d+ CUDA device\(s\), numbered from 0)"),
    (("--vllm-url", "http://127.0.0.1:9", "--base-model", "hosted-tinker/tiny-qwen3-embedded", "--base-model",
      "Qwen/Qwen3-8B"), r"--vllm-url: a vLLM sidecar samples one base model and 2 were given; run a server per model .*"),
])
def test_vllm_settings_that_cannot_work_are_one_line_before_the_model_loads(tmp_path, args, pattern):
    # From an empty directory: the default .venv-vllm (relative to where the server starts) is missing.
    assert_one_line_error(serve(tmp_path, *args, cwd=tmp_path), pattern)
    assert not (tmp_path / "data" / "models").exists()  # nothing slow ran


def test_vllm_devices_are_numbered_as_the_server_sees_them():
    assert vllm_child_devices("1", None) == "1"
    assert vllm_child_devices(None, "2,3") is None  # vLLM then sees what the server sees
    assert vllm_child_devices("1", "4,5,6") == "5"  # the server's cuda:1 is the machine's device 5
    assert vllm_child_devices("0,2", "GPU-a, GPU-b, GPU-c") == "GPU-a,GPU-c"


# -- several base models (issue 16) ------------------------------------------------------------------

@pytest.mark.parametrize("args, env, pattern", [
    (("--base-model", "Qwen/Qwen3-8B@gpu"), {},
     r"--base-model Qwen/Qwen3-8B@gpu: 'gpu' is not a device: use auto, cpu, cuda, cuda:N, mps or xpu after the '@'"),
    (("--base-model", "Qwen/Qwen3-8B", "--model", "Qwen/Qwen3-8B@cpu"), {},
     r"--base-model Qwen/Qwen3-8B Qwen/Qwen3-8B@cpu: 'Qwen/Qwen3-8B' given more than once: each base model is "
     r"served once"),
    ((), {"HOSTED_TINKER_BASE_MODEL": "Qwen/Qwen3-8B,@cpu"},
     r"\$HOSTED_TINKER_BASE_MODEL=Qwen/Qwen3-8B,@cpu: a base model needs a name before '@'"),
])
def test_a_bad_model_list_is_one_line_before_anything_starts(tmp_path, args, env, pattern):
    out = serve(tmp_path, *args, env=env)
    assert_one_line_error(out, pattern)
    assert not (tmp_path / "data").exists()


def test_every_served_model_is_found_before_any_loads_one_line_each(tmp_path):
    out = serve(tmp_path, env={"HOSTED_TINKER_BASE_MODEL": "Qwen/Qwen3-8B, Qwen/Qwen3-4B", "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2 and "Traceback" not in out.stderr and "loading base model" not in out.stderr
    lines = out.stderr.splitlines()
    assert [re.match(r"hosted-tinker serve: error: --base-model (\S+): not in the Hugging Face cache .* and "
                     r"HF_HUB_OFFLINE is set: ", line).group(1) for line in lines] == ["Qwen/Qwen3-8B", "Qwen/Qwen3-4B"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_models_own_device_is_checked_and_named_by_its_entry(tmp_path):
    out = serve(tmp_path, "--base-model", "hosted-tinker/tiny-qwen3-embedded", "--base-model", "Qwen/Qwen3-8B@cuda:1")
    assert_one_line_error(out, r"--base-model Qwen/Qwen3-8B@cuda:1: no cuda device is available to torch on this "
                               r"machine; use cpu \(or auto\) after the '@'")
    assert not (tmp_path / "data").exists()


def test_a_config_file_lists_models_each_with_its_device(tmp_path):
    config = tmp_path / "server.toml"
    config.write_text('device = "cpu"\nbase_model = ["org/student", "org/teacher@cuda:1"]\n')
    served = ServerConfig(config=config).served_models
    assert [(m.name, m.device) for m in served] == [("org/student", "cpu"), ("org/teacher", "cuda:1")]


def test_connections_on_the_bound_port_send_small_writes_at_once():
    """The port bind_port binds says TCP, so asyncio turns Nagle's algorithm off on every
    connection uvicorn accepts on it. It used to leave the protocol 0: Nagle stayed on, and a
    response's body, written after its headers, waited for the client's delayed ACK (~40 ms on
    every answer of the server)."""
    sock = bind_port("127.0.0.1", 0)

    async def accepted_connections_nodelay() -> int:
        accepted = asyncio.get_running_loop().create_future()

        def on_connection(reader, writer):
            accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        async with await asyncio.start_server(on_connection, sock=sock):  # as uvicorn serves it
            _, writer = await asyncio.open_connection(*sock.getsockname())
            nodelay = await accepted
            writer.close()
            return nodelay

    assert asyncio.run(accepted_connections_nodelay()) != 0
