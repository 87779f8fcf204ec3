"""Test helpers: a fake, offline Hugging Face cache holding tiny models and data sets.

Why: the cookbook's recipes accept only model names from their built-in table (e.g.
``Qwen/Qwen3-8B``) and some hard-code hub data sets (``HuggingFaceH4/no_robots``). Nothing
can be downloaded on development or CI machines, so we lay out a Hugging Face cache under a
temporary ``HF_HOME`` that holds our tiny model under the real name and a small synthetic
copy of the data set. With the variables from :func:`offline_env` (notably
``HF_HUB_OFFLINE=1``: without it transformers retries the hub for minutes), the server and the
cookbook load both *by name*, through their ordinary code paths.

Environment variables are read by huggingface_hub / datasets / transformers at import time,
so code that must see the fake cache should run in a subprocess started with
``env={**os.environ, **offline_env(hf_home)}``.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from hosted_tinker.models.embedded import TinyModelSpec, ensure_embedded_model

__all__ = [
    "flavor_for_repo",
    "install_fake_no_robots",
    "install_fake_hub_model",
    "install_hub_snapshot",
    "install_fake_dataset",
    "offline_env",
    "no_robots_rows",
]

if TYPE_CHECKING:
    import datasets


def flavor_for_repo(repo_id: str) -> str:
    """The tokenizer/template conventions a real checkpoint of this name has."""
    name = repo_id.split("/")[-1]
    if name.endswith("-Base"):
        return "qwen3_base"
    if "Instruct" in name:
        return "qwen3_instruct"
    return "qwen3"


def offline_env(hf_home: Path) -> dict[str, str]:
    """Variables for a subprocess that must use only the fake cache under ``hf_home``.

    The cache locations are set explicitly as well as ``HF_HOME`` so that a developer's own
    ``HF_HUB_CACHE`` / ``HF_DATASETS_CACHE`` cannot redirect the lookups.
    """
    hf_home = Path(hf_home).resolve()
    return {
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": str(hf_home / "hub"),
        "HF_DATASETS_CACHE": str(hf_home / "datasets"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TINKER_TELEMETRY": "0",
    }


def install_fake_hub_model(
    hf_home: Path,
    repo_id: str,
    spec: TinyModelSpec | None = None,
    build_cache: Path | None = None,
) -> Path:
    """Place a tiny model in the hub cache under ``repo_id``; return its snapshot directory.

    Layout (what huggingface_hub resolves offline)::

        $HF_HOME/hub/models--Org--Name/refs/main          -> "<commit>"
        $HF_HOME/hub/models--Org--Name/snapshots/<commit>/config.json, model.safetensors, ...

    Real caches store files as symlinks into ``blobs/``; plain files in the snapshot work the
    same for readers. ``spec`` defaults to the tiny shape with the flavor the real checkpoint
    has (``-Base`` -> eos ``<|endoftext|>``, ``Instruct`` -> no ``<think>`` template). The
    model is built once into ``build_cache`` (default ``$HF_HOME/.tiny-model-builds``) and
    copied, so installing several names costs one build.
    """
    hf_home = Path(hf_home)
    if spec is None:
        spec = TinyModelSpec(flavor=flavor_for_repo(repo_id))  # type: ignore[arg-type]
    built = ensure_embedded_model(build_cache or hf_home / ".tiny-model-builds", spec)
    return install_hub_snapshot(hf_home, repo_id, built, revision=spec.dir_name())


def install_hub_snapshot(hf_home: Path, repo_id: str, built: Path, revision: str = "") -> Path:
    """Copy the model directory ``built`` into the hub cache as ``repo_id``'s only snapshot
    (the layout :func:`install_fake_hub_model` describes); return the snapshot directory."""
    repo_dir = Path(hf_home) / "hub" / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(f"{repo_id}\n{revision}".encode()).hexdigest()
    snapshot = repo_dir / "snapshots" / commit
    if snapshot.parent.exists():  # only one snapshot, so refs/main is the only candidate
        shutil.rmtree(snapshot.parent)
    shutil.copytree(built, snapshot)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)  # huggingface_hub writes no newline
    return snapshot


def _datasets_cache_dir_name(repo_id: str) -> str:
    """``Org/Name`` -> ``Org___name``, exactly as datasets' cache lookup computes it."""
    from datasets.naming import camelcase_to_snakecase

    parts = repo_id.split("/")
    parts[-1] = camelcase_to_snakecase(parts[-1])
    return "___".join(parts)


def install_fake_dataset(
    hf_home: Path, repo_id: str, rows: list[dict], split: str = "train",
    config_name: str = "default", features: datasets.Features | None = None,
) -> None:
    """Make ``datasets.load_dataset(repo_id)`` return ``rows`` as ``split``, offline.

    With ``HF_HUB_OFFLINE=1`` datasets cannot ask the hub, and falls back to its own cache
    (``CachedDatasetModuleFactory`` + the ``cache`` builder) which looks for::

        $HF_DATASETS_CACHE/Org___name/<config>/<version>/<hash>/dataset_info.json
                                                          .../name-<split>.arrow

    We produce exactly that with datasets' own writer: load the rows with the ``json``
    builder into a scratch cache, then copy its output under the repo's name, renaming the
    ``json-<split>*.arrow`` files and fixing ``dataset_info.json``. Calling this again with
    another split adds it (all splits live in one cache entry); the same split replaces it.
    The rows of every split are kept as JSONL under ``$HF_HOME/.fake-dataset-sources``.

    ``features`` types the columns where JSON cannot, e.g. ``Image()`` (rows hold PIL images)
    or ``ClassLabel(names=...)`` (``int2str``): the rows are then kept as Parquet, which
    carries the features, and loaded with the ``parquet`` builder. Give every split the same
    ``features``.

    ``config_name`` is for data sets loaded with a config, e.g.
    ``load_dataset("openai/gsm8k", "main")``: install with ``config_name="main"``.
    """
    import datasets
    from datasets.naming import filename_prefix_for_name

    hf_home = Path(hf_home)
    dataset_name = repo_id.split("/")[-1]
    sources = hf_home / ".fake-dataset-sources" / repo_id.replace("/", "--") / config_name
    sources.mkdir(parents=True, exist_ok=True)
    builder, suffix = ("json", "jsonl") if features is None else ("parquet", "parquet")
    if features is None:
        with open(sources / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    else:
        datasets.Dataset.from_list(rows, features=features).to_parquet(sources / f"{split}.parquet")
    data_files = {p.stem: str(p) for p in sorted(sources.glob(f"*.{suffix}"))}

    config_root = hf_home / "datasets" / _datasets_cache_dir_name(repo_id) / config_name
    progress_was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory() as scratch:
            datasets.load_dataset(builder, data_files=data_files, cache_dir=scratch)
            (built,) = [p for p in Path(scratch, builder).glob("*/*/*") if p.is_dir()]
            version, hash_ = built.parts[-2:]
            if config_root.exists():
                shutil.rmtree(config_root)
            target = config_root / version / hash_
            target.mkdir(parents=True)
            prefix = filename_prefix_for_name(dataset_name)
            for src in built.glob(f"{builder}-*.arrow"):
                shutil.copy2(src, target / (prefix + src.name[len(builder):]))
            info = json.loads((built / "dataset_info.json").read_text(encoding="utf-8"))
            info.update(config_name=config_name, dataset_name=dataset_name)
            for split_info in info.get("splits", {}).values():
                split_info["dataset_name"] = dataset_name
            (target / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")
    finally:
        if progress_was_enabled:
            datasets.enable_progress_bars()


# ---------------------------------------------------------------------------------------------
# Synthetic HuggingFaceH4/no_robots rows
# ---------------------------------------------------------------------------------------------
_NO_ROBOTS_CATEGORIES = [
    "Generation", "Open QA", "Brainstorm", "Chat", "Rewrite", "Summarize", "Coding",
    "Classify", "Closed QA", "Extract",
]
_TOPICS = ["the ocean", "a small garden", "the moon", "bread", "a train journey", "winter",
           "a lost cat", "the library", "music", "a mountain village"]


def no_robots_rows(n: int = 48, seed: int = 0) -> list[dict]:
    """Rows shaped like ``HuggingFaceH4/no_robots``: prompt, prompt_id, messages, category.

    ``messages`` is a list of ``{"role", "content"}`` dicts: some rows start with a system
    message, some are multi-turn (user/assistant alternating), all end with an assistant
    turn -- the shapes the cookbook's chat SL recipes meet in the real data set.
    """
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        topic = rng.choice(_TOPICS)
        category = _NO_ROBOTS_CATEGORIES[i % len(_NO_ROBOTS_CATEGORIES)]
        prompt = f"Please write a short note about {topic}. Keep it under {rng.randint(2, 5)} sentences."
        messages = []
        if i % 4 == 1:
            messages.append({"role": "system", "content": "You are a friendly, concise assistant."})
        messages.append({"role": "user", "content": prompt})
        messages.append({"role": "assistant",
                         "content": f"Here is a note about {topic}. It is calm, simple and "
                                    f"{rng.choice(['bright', 'quiet', 'warm', 'old'])}."})
        if i % 3 == 2:
            messages.append({"role": "user", "content": "Thanks! Can you make it shorter?"})
            messages.append({"role": "assistant", "content": f"Sure: {topic} is lovely."})
        prompt_id = hashlib.sha256(f"{seed}-{i}-{prompt}".encode()).hexdigest()
        rows.append({"prompt": prompt, "prompt_id": prompt_id, "messages": messages,
                     "category": category})
    return rows


def install_fake_no_robots(hf_home: Path, n_train: int = 48, n_test: int = 16) -> None:
    """Install both splits of a synthetic ``HuggingFaceH4/no_robots`` (the recipes use both)."""
    install_fake_dataset(hf_home, "HuggingFaceH4/no_robots", no_robots_rows(n_train, seed=0),
                         "train")
    install_fake_dataset(hf_home, "HuggingFaceH4/no_robots", no_robots_rows(n_test, seed=1),
                         "test")


if __name__ == "__main__":  # pragma: no cover - manual helper
    import sys

    home = Path(sys.argv[1])
    for name in sys.argv[2:] or ["Qwen/Qwen3-8B"]:
        print(install_fake_hub_model(home, name))
    install_fake_no_robots(home)
    print("\n".join(f"export {k}={v}" for k, v in offline_env(home).items()))
