"""Unit tests of checkpoint files: exact save/restore of weights and AdamW state, PEFT
compatibility in both directions, checksum detection, overwrite protection, and atomic writes
that leave no temporary directories."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, load_file

from hosted_tinker.checkpoints import adapter_io as checkpoints
from hosted_tinker.checkpoints.paths import InvalidPath, TinkerPath
from hosted_tinker.runtime.adapters import AdamParams, LoRAConfig
from hosted_tinker.checkpoints.format import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MANIFEST,
    OPTIMIZER_STATE,
    PEFT_PREFIX,
    CheckpointError,
    read_checkpoint,
)
from hosted_tinker.checkpoints.adapter_io import (
    check_fits,
    load_checkpoint,
    read_checkpoint_for,
    restore_adapter,
    save_adapter,
    save_checkpoint,
)
from tiny_model import TINY_VOCAB as VOCAB, ce_work, logits, one_torch_thread, random_seqs, randomize_b, tiny_qwen3, \
    tiny_runtime  # noqa: F401 (one_torch_thread: an autouse fixture)

PARAMS = AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)
CFG = LoRAConfig(rank=4, seed=3)  # attn + mlp + unembed


def train_steps(rt, model_id: str, steps: int, seed: int = 0) -> None:
    for i in range(steps):
        rt.forward_backward([ce_work(model_id, random_seqs(3, seed + i))])
        rt.optim_step(model_id, PARAMS)


@pytest.fixture
def trained():
    """A runtime with adapter "a" after two AdamW steps (non-zero B and moments)."""
    rt = tiny_runtime()
    rt.create_adapter("a", CFG)
    train_steps(rt, "a", 2)
    return rt


def no_temp_dirs(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_round_trip_is_bit_exact_and_training_continues_identically(trained, tmp_path):
    """save(with optimizer) -> read -> load gives bit-identical weights, moments and step, and
    the next step matches the one taken without the save/restore."""
    a = trained.adapter("a")
    out = tmp_path / "ckpts" / "step-2"
    size = save_checkpoint(trained, "a", out, with_optimizer=True)
    assert size == sum(f.stat().st_size for f in out.iterdir())
    assert sorted(f.name for f in out.iterdir()) == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST, OPTIMIZER_STATE])
    assert no_temp_dirs(out.parent)

    ckpt = read_checkpoint_for(trained, out, with_optimizer=True)
    assert ckpt.config == CFG and ckpt.step == 2 and ckpt.base_model == "tiny-qwen3"
    b = load_checkpoint(trained, "b", ckpt)
    assert b.config == CFG and b.step == 2
    ta, tb = a.named_tensors(), b.named_tensors()
    assert list(ta) == list(tb)
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    for pa, pb in zip(a.parameters(), b.parameters()):
        sa, sb = a.optimizer.state[pa], b.optimizer.state[pb]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        assert float(sa["step"]) == float(sb["step"]) == 2.0

    seqs = random_seqs(3, 99)
    for mid in ("a", "b"):
        trained.forward_backward([ce_work(mid, seqs)])
        trained.optim_step(mid, PARAMS)
    ta, tb = a.named_tensors(), b.named_tensors()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


def test_restore_without_optimizer_resets_moments(trained, tmp_path):
    """A sampler save has no optimizer state: loading it with the optimizer is refused, and
    loading the weights alone starts AdamW fresh."""
    out = tmp_path / "sampler"
    save_checkpoint(trained, "a", out, with_optimizer=False)
    assert not (out / OPTIMIZER_STATE).exists()
    with pytest.raises(CheckpointError, match="has no optimizer state"):
        read_checkpoint(out, with_optimizer=True)
    b = load_checkpoint(trained, "b", read_checkpoint(out, with_optimizer=False))
    assert not b.optimizer.state
    for k, v in trained.adapter("a").named_tensors().items():
        assert torch.equal(v, b.named_tensors()[k])


def test_restore_adapter_rejects_a_checkpoint_of_another_shape(trained, tmp_path):
    """Loading a rank-4 checkpoint into a rank-8 adapter is a CheckpointError, not a crash."""
    out = tmp_path / "r4"
    save_checkpoint(trained, "a", out, with_optimizer=False)
    ckpt = read_checkpoint(out, with_optimizer=False)
    other = trained.create_adapter("r8", LoRAConfig(rank=8, seed=0))
    with pytest.raises(CheckpointError, match="shape"):
        restore_adapter(other, ckpt)
    narrow = trained.create_adapter("attn-only", LoRAConfig(rank=4, train_mlp=False, train_unembed=False))
    with pytest.raises(CheckpointError, match="does not fit"):
        restore_adapter(narrow, ckpt)


def test_failed_load_leaves_the_model_as_it_was(trained, tmp_path):
    """TrainingRuntime.load of an unusable checkpoint keeps the old adapter attached."""
    out = tmp_path / "ok"
    save_checkpoint(trained, "a", out, with_optimizer=False)
    ckpt = read_checkpoint(out, with_optimizer=False)
    ckpt.tensors.popitem()  # now it does not fit
    old = trained.adapter("a")
    with pytest.raises(CheckpointError):
        load_checkpoint(trained, "a", ckpt)
    assert trained.adapter("a") is old
    assert all(layer.adapters.get("a") is w for path, w in old.weights.items()
               for layer in [trained.layers[path]])


def test_saved_adapter_loads_in_peft_with_same_logits(trained, tmp_path):
    """The checkpoint is a standard PEFT adapter: PeftModel gives our runtime's logits."""
    from peft import PeftModel

    out = tmp_path / "for-peft"
    save_checkpoint(trained, "a", out, with_optimizer=False)
    cfg = json.loads((out / ADAPTER_CONFIG).read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == CFG.alpha and cfg["peft_type"] == "LORA"
    assert set(cfg["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                          "down_proj", "lm_head"}
    assert all(k.startswith(PEFT_PREFIX) for k in load_file(str(out / ADAPTER_WEIGHTS)))

    peft_model = PeftModel.from_pretrained(tiny_qwen3(), str(out)).eval()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = peft_model(input_ids=ids, use_cache=False).logits
    got = logits(trained, ids, [("a", 0, 2)])
    base = logits(trained, ids, [])
    assert not torch.allclose(got, base, atol=1e-3)  # the adapter matters
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("victim", [ADAPTER_WEIGHTS, OPTIMIZER_STATE, ADAPTER_CONFIG])
def test_corrupted_file_is_detected_by_checksum(trained, tmp_path, victim):
    """Flipping one byte of any listed file makes read_checkpoint fail with a checksum error."""
    out = tmp_path / "c"
    save_checkpoint(trained, "a", out, with_optimizer=True)
    path = out / victim
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{victim}: checksum mismatch"):
        read_checkpoint(out, with_optimizer=True)


def test_overwrite_false_refuses_and_leaves_existing_dir_intact(trained, tmp_path):
    """A second save to an existing name fails without touching it; overwrite=True replaces it."""
    out = tmp_path / "ckpts" / "name"
    save_checkpoint(trained, "a", out, with_optimizer=True)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    train_steps(trained, "a", 1, seed=50)  # the weights change
    with pytest.raises(CheckpointError, match="already exists"):
        save_checkpoint(trained, "a", out, with_optimizer=True)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert no_temp_dirs(out.parent)

    save_checkpoint(trained, "a", out, with_optimizer=True, overwrite=True)
    after = read_checkpoint(out, with_optimizer=True)
    assert after.step == 3
    for k, v in trained.adapter("a").named_tensors().items():
        assert torch.equal(after.tensors[k], v)
    assert sorted(p.name for p in out.parent.iterdir()) == ["name"]


def test_failed_write_leaves_nothing_behind(trained, tmp_path, monkeypatch):
    """An error half-way through writing leaves neither the checkpoint nor a temp dir."""
    def broken_save_file(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoints, "save_file", broken_save_file)
    parent = tmp_path / "ckpts"
    with pytest.raises(OSError, match="disk full"):
        save_adapter(trained.adapter("a"), parent / "x", "tiny-qwen3", with_optimizer=True)
    assert list(parent.iterdir()) == []


def test_peft_made_adapter_reads_back_and_reproduces_peft_logits(tmp_path):
    """An adapter saved by PEFT itself (q_proj+v_proj, r=4) gets a derived LoRAConfig and, once
    restored into our runtime, reproduces PEFT's logits."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny_qwen3(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                         lora_dropout=0.0))
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    peft_model.eval()
    out = tmp_path / "peft-made"
    peft_model.save_pretrained(str(out))
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = peft_model(input_ids=ids, use_cache=False).logits

    rt = tiny_runtime()
    ckpt = read_checkpoint(out, with_optimizer=False, layers=rt.layers)  # the roles are the served model's
    assert (ckpt.config.rank, ckpt.config.alpha, ckpt.step) == (4, 8.0, 0)
    assert ckpt.config.train_attn and not ckpt.config.train_mlp and not ckpt.config.train_unembed
    assert ckpt.config.target_modules == ("q_proj", "v_proj")
    assert {k.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in ckpt.tensors} == {"q_proj", "v_proj"}
    with pytest.raises(CheckpointError, match="has no optimizer state"):
        read_checkpoint(out, with_optimizer=True)

    adapter = load_checkpoint(rt, "p", ckpt)
    assert set(adapter.weights) == {k.rsplit(".lora_", 1)[0] for k in ckpt.tensors}
    got = logits(rt, ids, [("p", 0, 2)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, logits(rt, ids, []), atol=1e-3)

    # Training it further and saving gives our own checkpoint that keeps the narrow targets.
    train_steps(rt, "p", 1)
    again = tmp_path / "ours"
    save_checkpoint(rt, "p", again, with_optimizer=True)
    back = read_checkpoint(again, with_optimizer=True)
    assert back.config == adapter.config and back.config.target_modules == ("q_proj", "v_proj")
    assert json.loads((again / ADAPTER_CONFIG).read_text())["target_modules"] == ["q_proj", "v_proj"]
    load_checkpoint(rt, "p2", back)


def test_read_rejects_a_directory_without_adapter_files(tmp_path):
    """A directory missing adapter_config.json / adapter_model.safetensors is not a checkpoint."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a LoRA adapter"):
        read_checkpoint(tmp_path / "empty", with_optimizer=False)


def test_checkpoint_of_another_base_model_is_refused(trained, tmp_path):
    """TrainingRuntime.read refuses a checkpoint trained on a different base model."""
    out = tmp_path / "other-base"
    save_adapter(trained.adapter("a"), out, "some/other-model", with_optimizer=False)
    with pytest.raises(CheckpointError, match="some/other-model"):
        read_checkpoint_for(trained, out, with_optimizer=False)


def test_randomized_adapter_round_trips_through_save(tmp_path):
    """A multi-adapter runtime: saving one adapter and loading it elsewhere reproduces its rows."""
    rt = tiny_runtime()
    randomize_b(rt.create_adapter("a", CFG), seed=1)
    randomize_b(rt.create_adapter("b", LoRAConfig(rank=8, seed=4, train_attn=False)), seed=2)
    save_checkpoint(rt, "b", tmp_path / "b", with_optimizer=False)
    ids = torch.randint(0, VOCAB, (3, 6), generator=torch.Generator().manual_seed(8))
    want = logits(rt, ids, [("b", 0, 3)])
    rt2 = tiny_runtime()
    load_checkpoint(rt2, "b", read_checkpoint_for(rt2, tmp_path / "b", with_optimizer=False))
    assert torch.equal(logits(rt2, ids, [("b", 0, 3)]), want)


def test_tinker_path_parses_and_prints_every_path_strictly():
    """TinkerPath is the only reader and writer of tinker:// paths; names are matched whole."""
    path = TinkerPath.parse("tinker://sess-1a:train:0/sampler_weights/step-10")
    assert (path.run, path.kind, path.name) == ("sess-1a:train:0", "sampler_weights", "step-10")
    assert str(path) == "tinker://sess-1a:train:0/sampler_weights/step-10"
    assert path.checkpoint_id == "sampler_weights/step-10" and path.checkpoint_type == "sampler"
    assert TinkerPath.of_record("r", "weights/a") == TinkerPath("r", "weights", "a")
    for bad in ("tinker://r/weights/a\n", "tinker://r\n/weights/a", "tinker://r/weights/a/b", "tinker://r/weights",
                "tinker://../weights/a", "tinker://r/weights/..", "tinker://r/weights/.a", "tinker://r/bogus/a",
                "s3://r/weights/a", "tinker://r/weights/" + "a" * 129, "tinker://r/weights/a b"):
        with pytest.raises(InvalidPath):
            TinkerPath.parse(bad)


def test_read_opens_only_plain_files_of_the_checkpoint(trained, tmp_path):
    """A checkpoint file that is a link or a FIFO is refused without following or blocking on
    it, and the message names the file, never a server path."""
    out = tmp_path / "c"
    save_checkpoint(trained, "a", out, with_optimizer=True)
    secret = tmp_path / "elsewhere.safetensors"
    (out / ADAPTER_WEIGHTS).rename(secret)
    (out / ADAPTER_WEIGHTS).symlink_to(secret)
    with pytest.raises(CheckpointError, match=f"{ADAPTER_WEIGHTS} cannot be opened") as err:
        read_checkpoint(out, with_optimizer=False)
    assert str(tmp_path) not in str(err.value)
    (out / ADAPTER_WEIGHTS).unlink()
    secret.rename(out / ADAPTER_WEIGHTS)
    (out / OPTIMIZER_STATE).unlink()
    os.mkfifo(out / OPTIMIZER_STATE)  # opening a FIFO for reading would wait for a writer forever
    with pytest.raises(CheckpointError, match=f"{OPTIMIZER_STATE} is not a regular file"):
        read_checkpoint(out, with_optimizer=True)


def test_fits_refuses_rank_above_the_limit_and_optimizer_state_of_other_shapes(trained, tmp_path):
    """check_fits (import and every load) holds the rank limit; optimizer moments of another
    shape are refused up front, since the AdamW step is fused across tenants."""
    out = tmp_path / "c"
    save_checkpoint(trained, "a", out, with_optimizer=True)
    ckpt = read_checkpoint(out, with_optimizer=True)
    check_fits(ckpt, trained.layers, max_rank=4)
    with pytest.raises(CheckpointError, match="LoRA rank 4, above this server's limit of 3"):
        check_fits(ckpt, trained.layers, max_rank=3)
    name = next(k for k in ckpt.optimizer if k.endswith(".exp_avg"))
    ckpt.optimizer[name] = ckpt.optimizer[name].t().contiguous()
    with pytest.raises(CheckpointError, match="does not fit its weights"):
        check_fits(ckpt, trained.layers, max_rank=4)
    with pytest.raises(CheckpointError, match="does not fit its weights"):
        load_checkpoint(trained, "b", ckpt)


def test_an_encrypted_export_survives_recovery_and_leaves_no_plaintext(trained, tmp_path):
    """An age-encrypted export holds only `.age` files; start-up recovery keeps its record, and
    removes the plaintext folder a crash between writing and encrypting would leave."""
    import pyrage

    from hosted_tinker.checkpoints.catalog import CheckpointCatalog
    from hosted_tinker.checkpoints.encryption import parse_recipients, save_encrypted
    from hosted_tinker.checkpoints.recovery import recover
    from hosted_tinker.store.tables import Store

    store = Store(tmp_path / "db.sqlite")
    store.sessions.create("s", "alice", [], {}, None, None)
    store.runs.create("run", "s", "alice", "tiny", CFG.to_dict(), {}, {})
    catalog = CheckpointCatalog(store, tmp_path / "checkpoints")
    identity = pyrage.x25519.Identity.generate()
    path = TinkerPath("run", "external_weights", "enc")
    catalog.save(path, "alice", lambda folder: save_encrypted(
        folder, lambda out: save_checkpoint(trained, "a", out, with_optimizer=False), parse_recipients([str(identity.to_public())])),
        overwrite=True)
    folder = catalog.folder(path)
    assert sorted(f.name for f in folder.iterdir()) == [
        "adapter_config.json.age", "adapter_model.safetensors.age", "manifest.json.age"]
    crashed = folder.parent / ".tmp-enc-plain-0123abcd"  # what a kill before the encryption leaves
    save_checkpoint(trained, "a", crashed, with_optimizer=False)

    report = recover(catalog)
    assert catalog.record(path) is not None and not report.removed_records
    assert not crashed.exists() and no_temp_dirs(folder.parent)
    tensors = load(pyrage.decrypt((folder / "adapter_model.safetensors.age").read_bytes(), [identity]))
    want = trained.adapters["a"].named_tensors()
    assert all(torch.equal(tensors[PEFT_PREFIX + k], v.float()) for k, v in want.items())
