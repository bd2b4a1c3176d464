"""docs/loader.md's table of what ``decode=True`` gives, per extension, for ShardDataset batches
and loader.core batches (images are covered by test_example_training)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch

import shardprep
from loader import ShardDataset
from loader.core import ShardStream
from loader.read.npbatch import PackedBytes
from loader.torch.batch import Packed


def test_decode_true_gives_what_the_docs_say(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(6):
        array = io.BytesIO()
        np.save(array, np.full(3, i, dtype=np.float32))
        (raw / f"{i:03d}.npy").write_bytes(array.getvalue())
        (raw / f"{i:03d}.cls").write_text(str(i % 2))
        (raw / f"{i:03d}.weight").write_text("1.5")
        (raw / f"{i:03d}.txt").write_text("hi")
        (raw / f"{i:03d}.json").write_text(json.dumps({"a": i}))
        (raw / f"{i:03d}.bin").write_bytes(b"xx")
    out = tmp_path / "out"
    shardprep.build(str(raw), str(out), shards=2, input_format="keyed", progress=False)

    sample = next(iter(ShardDataset(str(out), decode=True)))
    assert {k: type(v) for k, v in sample.items() if not k.startswith("__")} == {
        "cls": int, "weight": float, "txt": str, "json": dict, "npy": np.ndarray, "bin": bytes,
    }  # fmt: skip

    batch = next(iter(ShardDataset(str(out), batch_size=3, decode=True)))
    assert isinstance(batch["cls"], torch.Tensor) and batch["cls"].dtype == torch.int64
    assert isinstance(batch["weight"], torch.Tensor) and batch["weight"].dtype == torch.float64
    assert batch["txt"] == ["hi"] * 3
    assert [type(v) for v in batch["json"]] == [dict] * 3
    assert batch["npy"].dtype == torch.float32 and tuple(batch["npy"].shape) == (3, 3)
    assert isinstance(batch["bin"], Packed)

    core = next(
        iter(ShardStream(str(out), batch_size=3, decode=True).iterate(0, rank=0, world_size=1))
    )
    assert core["cls"].dtype == np.int64 and core["weight"].dtype == np.float64
    assert isinstance(core["npy"], np.ndarray) and core["npy"].shape == (3, 3)
    assert core["txt"] == ["hi"] * 3
    assert isinstance(core["bin"], PackedBytes)


def _tone(frames: int, channels: int) -> np.ndarray:
    t = np.arange(frames, dtype=np.float32)[:, None]
    return (0.5 * np.sin(t / (5 + np.arange(channels)))).astype(np.float32)


def test_audio_members_decode_to_a_waveform_and_its_rate(tmp_path: Path) -> None:
    """wav/flac/ogg/mp3 members: (float32 (channels, frames), sample rate) as soundfile reads
    the same bytes; a tensor from ShardDataset, a NumPy array from loader.core."""
    import soundfile

    raw = tmp_path / "raw"
    raw.mkdir()
    expected = {}
    for i, fmt in enumerate(["wav", "flac", "ogg", "mp3"]):
        data = io.BytesIO()
        soundfile.write(data, _tone(800 + 16 * i, 1 + i % 2), 8000 + 8000 * (i % 2), format=fmt)
        (raw / f"{i:03d}.{fmt}").write_bytes(data.getvalue())
        wave, rate = soundfile.read(io.BytesIO(data.getvalue()), dtype="float32", always_2d=True)
        expected[f"{i:03d}"] = (fmt, wave.T, rate)
    out = tmp_path / "out"
    shardprep.build(str(raw), str(out), shards=1, input_format="keyed", progress=False)

    seen = {}
    for sample in ShardDataset(str(out), decode=True, shuffle=False):
        fmt, wave, rate = expected[sample["__key__"]]
        got, got_rate = sample[fmt]
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
        assert got_rate == rate and np.array_equal(got.numpy(), wave)
        seen[sample["__key__"]] = got.shape
    assert seen == {k: tuple(w.shape) for k, (_, w, _) in expected.items()}
    assert [s[1] for s in seen.values()] and all(s[0] in (1, 2) for s in seen.values())

    core = ShardStream(str(out), decode=True, shuffle=False).iterate(0)
    for sample in core:
        fmt, wave, rate = expected[sample["__key__"]]
        got, got_rate = sample[fmt]
        assert isinstance(got, np.ndarray) and np.array_equal(got, wave) and got_rate == rate


def test_audio_without_soundfile_says_what_to_install(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import sys

    import pytest

    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "000.wav").write_bytes(b"RIFF....WAVE")
    out = tmp_path / "out"
    shardprep.build(str(raw), str(out), shards=1, input_format="keyed", progress=False)
    monkeypatch.setitem(sys.modules, "soundfile", None)
    with pytest.raises(ImportError, match=r"pip install 'shardprep\[audio\]'"):
        next(iter(ShardStream(str(out), decode=True).iterate(0)))


def test_a_batch_of_audio_is_a_list_of_pairs(tmp_path: Path) -> None:
    """Waveforms differ in length: a batch holds them as (waveform, rate) pairs, in order."""
    import soundfile

    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(4):
        data = io.BytesIO()
        soundfile.write(data, _tone(100 + i, 1), 8000, format="wav")
        (raw / f"{i:03d}.wav").write_bytes(data.getvalue())
    out = tmp_path / "out"
    shardprep.build(str(raw), str(out), shards=1, input_format="keyed", progress=False)
    batch = next(iter(ShardDataset(str(out), batch_size=4, decode=True)))
    lengths = [(tuple(w.shape), r) for w, r in batch["wav"]]
    assert lengths == [((1, 100 + int(k)), 8000) for k in batch["__key__"]]
    core = next(iter(ShardStream(str(out), batch_size=4, decode=True).iterate(0)))
    lengths = [(w.shape, r) for w, r in core["wav"]]
    assert lengths == [((1, 100 + int(k)), 8000) for k in core["__key__"]]
    assert sorted(core["__key__"]) == ["000", "001", "002", "003"]
