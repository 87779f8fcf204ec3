"""All server settings in one dataclass; `hosted-tinker serve --help` is generated from it."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from .embedded_model import EMBEDDED_MODEL_NAME


def _opt(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ServerConfig:
    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8000, "port to listen on")
    base_model: str = _opt(
        EMBEDDED_MODEL_NAME,
        "Hugging Face causal LM id or local path (e.g. Qwen/Qwen3-8B); the default is a tiny "
        "model built locally, deterministically, with no download")
    data_dir: Path = _opt(Path("./data"), "where the SQLite database, checkpoints and built models live")
    device: str = _opt("auto", "torch device: auto (cuda if available, else cpu), cpu, cuda, cuda:1 ...")
    dtype: str = _opt("auto", "base model dtype: auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16")
    max_tokens_per_micro_batch: int = _opt(
        0, "padded tokens per fused forward/backward micro-batch (bounds activation memory); 0 = auto: "
           "8192 on GPU; on CPU 512-8192 by the model's MLP width, since passes whose activations "
           "outgrow the caches run slower per token")
    max_tokens_per_cycle: int = _opt(
        65536, "tokens of forward/backward work packed into one clock cycle, shared fairly across models")
    max_live_adapters: int = _opt(
        64, "adapters kept on the device; idle ones beyond this are paged out to CPU memory (with their "
            "optimizer state) and back on their next request")
    max_sampler_snapshots: int = _opt(
        64, "sampler adapter snapshots kept loaded; others are reloaded from disk when sampled again")
    max_num_samples: int = _opt(128, "largest num_samples per sample request")
    default_max_tokens: int = _opt(512, "max_tokens when a sample request leaves it unset")
    ephemeral_sampler_ttl_s: int = _opt(
        7 * 24 * 3600, "how long snapshots made by save_weights_and_get_sampling_client are kept on disk")
    sample_record_ttl_s: float = _opt(
        24 * 3600.0, "how long a sample recorded with record_stability_info stays trainable after its last use")
    max_lora_rank: int = _opt(128, "largest LoRA rank a client may ask for")
    long_poll_s: float = _opt(30.0, "how long retrieve_future holds a pending request before try_again")
    gap_timeout_s: float = _opt(
        120.0, "how long a model's later seq_ids wait for a missing earlier one before it is skipped")
    gather_window_s: float = _opt(
        0.05, "how long a pipelining client's forward_backward waits for its optim_step, to share a cycle "
              "(only clients seen posting optim_step before their forward_backward finished wait)")
    max_datums_per_request: int = _opt(1024, "datums per forward_backward request (the SDK chunks to this)")
    max_pending_per_key: int = _opt(
        4096, "unfinished requests one API key may have queued; beyond it submissions get 429 (back-pressure)")
    max_models_per_key: int = _opt(64, "live training models one API key may hold (unload one to make room)")
    max_request_bytes: int = _opt(512 << 20, "largest request body accepted (after decompression)")
    api_keys_file: Path | None = _opt(
        None, "file of accepted API keys, one 'owner: tml-key' per line (also read: $HOSTED_TINKER_API_KEYS, "
              "comma-separated); with neither, dev mode accepts any tml- key")
    compress_fwdbwd: bool = _opt(False, "ask the SDK to zstd-compress forward_backward bodies (saves bandwidth to remote clients)")
    log_level: str = _opt("info", "debug, info, warning or error")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if f.type in (bool, "bool"):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                    help=f"{f.metadata['help']} (default: %(default)s)")
                continue
            kind = f.type if not isinstance(f.type, str) else {"int": int, "float": float, "Path": Path,
                                                                 "Path | None": Path}.get(f.type, str)
            parser.add_argument(flag, type=kind, default=f.default, help=f"{f.metadata['help']} (default: %(default)s)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerConfig":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
