"""Item 2 of issue 9: every read is checked against the per-member checksums in the index.

A flipped byte in a plain .tar sample, damage inside a zstd frame and a truncated
shard are each an error naming the damaged (or first incomplete) sample, not the
start of the range; ``on_error="skip"`` replaces exactly the damaged sample; and
``shardprep verify`` names the damaged keys.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

import shardprep
from loader import CorruptShardError, ReadOptions, ShardDataset
from shardprep.format.manifest import read_manifest
from shardprep.verify import verify_output
from tests.faults.shard_surgery import copy_output, index_of

TOTAL = 103  # conftest ``built``: 60/30/13 samples in 8 plain shards


def _keys_before(out: Path, shard: int) -> list[str]:
    """Keys in stream order with shuffle=False (shards in order) up to ``shard``."""
    keys = []
    for s in range(shard):
        index = index_of(out, s)
        keys += [index.key(i) for i in range(index.num_samples)]
    return keys


def _flip(path: Path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0x55
    path.write_bytes(bytes(data))


def test_flipped_byte_in_a_plain_sample_names_that_sample(built: Path, tmp_path: Path) -> None:
    out = copy_output(built, tmp_path / "out")
    index = index_of(out, 4)
    victim = 6
    member = int(index.member_start[victim])
    _flip(out / "shard-00004.tar", int(index.member_offset[member]) + 3)
    delivered = []
    with pytest.raises(CorruptShardError, match="checksum mismatch in its .bin member") as info:
        for sample in ShardDataset(str(out), shuffle=False):
            delivered.append(sample["__key__"])
    assert info.value.shard == str(out / "shard-00004.tar")
    assert info.value.key == index.key(victim)
    assert info.value.offset == int(index.sample_offset[victim])
    # every sample before the damaged one came out, intact, and nothing after it
    assert delivered == _keys_before(out, 4) + [index.key(i) for i in range(victim)]


def test_the_error_from_a_dataloader_worker_keeps_shard_key_offset_and_reason(
    built: Path, tmp_path: Path
) -> None:
    """DataLoader re-raises a worker's error from its message alone; the fields come back."""
    from torch.utils.data import DataLoader

    out = copy_output(built, tmp_path / "out")
    index = index_of(out, 4)
    member = int(index.member_start[6])
    _flip(out / "shard-00004.tar", int(index.member_offset[member]) + 3)
    with pytest.raises(CorruptShardError) as here:
        list(ShardDataset(str(out), shuffle=False))
    loader = DataLoader(ShardDataset(str(out), shuffle=False), batch_size=None, num_workers=1)
    with pytest.raises(CorruptShardError) as there:
        list(loader)
    assert str(there.value).startswith("Caught CorruptShardError in DataLoader worker process 0")
    fields = ("shard", "key", "offset", "reason")
    assert [getattr(there.value, f) for f in fields] == [getattr(here.value, f) for f in fields]
    assert (there.value.shard, there.value.key) == (str(out / "shard-00004.tar"), index.key(6))


@pytest.mark.parametrize(
    "key", ["plain", "it's", 'say "hi"', "a: sample 'x' at offset 3: b", "back\\slash", "ünï"]
)
def test_the_fields_are_read_back_whatever_the_key(key: str) -> None:
    original = CorruptShardError.at("s3://b/o: x/shard-00001.tar", key, 17, "checksum mismatch")
    wrapped = (
        "Caught CorruptShardError in DataLoader worker process 1.\nOriginal Traceback (most "
        f'recent call last):\n  File "x.py", line 1, in f\nloader.errors.CorruptShardError: '
        f"{original}\n"
    )
    again = CorruptShardError(wrapped)
    assert (again.shard, again.key, again.offset, again.reason) == (
        "s3://b/o: x/shard-00001.tar",
        key,
        17,
        "checksum mismatch",
    )
    # a message not from a worker, or not written by ``at``, leaves the fields empty
    assert CorruptShardError(str(original)).shard == ""
    plain = CorruptShardError.at("shard-00001.tar", "k", 17, "checksum mismatch")
    assert CorruptShardError(wrapped.replace(str(original), str(plain))).shard == "shard-00001.tar"
    assert (
        CorruptShardError(wrapped.replace(str(original), "shard-00001.tar: short read")).shard == ""
    )


def test_skip_replaces_exactly_the_damaged_sample(built: Path, tmp_path: Path) -> None:
    out = copy_output(built, tmp_path / "out")
    index = index_of(out, 2)
    _flip(out / "shard-00002.tar", int(index.member_offset[int(index.member_start[3])]))
    samples = list(ShardDataset(str(out), read=ReadOptions(on_error="skip")))
    assert len(samples) == TOTAL
    assert sum(s["__padded__"] for s in samples) == 1
    real = [s["__key__"] for s in samples if not s["__padded__"]]
    everything = _keys_before(out, 8)
    assert sorted(real) == sorted(k for k in everything if k != index.key(3))


def test_damaged_label_member_is_caught_too(built: Path, tmp_path: Path) -> None:
    out = copy_output(built, tmp_path / "out")
    index = index_of(out, 0)
    last_member = int(index.member_start[1]) - 1  # sample 0's .cls
    assert index.exts[int(index.member_ext[last_member])] == "cls"
    _flip(out / "shard-00000.tar", int(index.member_offset[last_member]))
    with pytest.raises(CorruptShardError, match=r"\.cls member") as info:
        list(ShardDataset(str(out), shuffle=False))
    assert info.value.key == index.key(0)


def test_truncated_tar_names_the_first_incomplete_sample(built: Path, tmp_path: Path) -> None:
    out = copy_output(built, tmp_path / "out")
    index = index_of(out, 3)
    cut = int(index.sample_offset[5]) + 700  # inside sample 5
    path = out / "shard-00003.tar"
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(CorruptShardError, match="truncated") as info:
        list(ShardDataset(str(out), shuffle=False))
    assert (info.value.key, info.value.offset) == (index.key(5), int(index.sample_offset[5]))
    assert info.value.shard == str(path)


@pytest.fixture(scope="module")
def built_raw_zstd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A zstd build of incompressible payloads: zstd stores them verbatim (raw blocks),
    so a byte of a payload can be found, and damaged, in the compressed file."""
    base = tmp_path_factory.mktemp("raw_zstd")
    rng = random.Random(7)
    for label, count in (("a", 200), ("b", 100)):
        folder = base / "raw" / label
        folder.mkdir(parents=True)
        for i in range(count):
            (folder / f"{label}{i:04d}.bin").write_bytes(rng.randbytes(2500 + 13 * (i % 40)))
    shardprep.build(
        str(base / "raw"),
        str(base / "out"),
        shards=2,
        workers=1,
        compression="zstd",
        progress=False,
    )
    return base / "out"


def _payload(out: Path, shard: int, sample: int) -> bytes:
    """The .bin payload of ``sample`` as the uncompressed tar holds it."""
    import zstandard

    tar = (
        zstandard.ZstdDecompressor()
        .stream_reader((out / f"shard-{shard:05d}.tar.zst").read_bytes(), read_across_frames=True)
        .read()
    )
    index = index_of(out, shard)
    m = int(index.member_start[sample])
    start = int(index.member_offset[m])
    return tar[start : start + int(index.member_size[m])]


def test_zstd_damage_names_the_damaged_sample_not_the_frame_start(
    built_raw_zstd: Path, tmp_path: Path
) -> None:
    out = copy_output(built_raw_zstd, tmp_path / "out")
    index = index_of(out, 1)
    assert len(index.frame_sample) >= 4  # several frames
    victim = int(index.frame_sample[1]) + 7  # inside frame 1, not its first sample
    snippet = _payload(out, 1, victim)[1000:1064]
    path = out / "shard-00001.tar.zst"
    data = path.read_bytes()
    where = data.find(snippet)
    assert where > 0 and data.find(snippet, where + 1) == -1
    _flip(path, where + 10)
    with pytest.raises(CorruptShardError, match="zstd frame 1") as info:
        list(ShardDataset(str(out), shuffle=False))
    assert info.value.key == index.key(victim) != index.key(int(index.frame_sample[1]))
    assert info.value.offset == int(index.sample_offset[victim])
    # verify names the same frame and the same sample
    problems = verify_output(str(out)).problems
    assert any("zstd frame 1 at offset" in p for p in problems)
    assert (
        f"shard-00001.tar.zst: 1 damaged sample(s) (missing bytes or checksum mismatch): {index.key(victim)!r}"
        in "\n".join(problems)
    )


def test_truncated_zstd_names_the_first_incomplete_sample(
    built_raw_zstd: Path, tmp_path: Path
) -> None:
    out = copy_output(built_raw_zstd, tmp_path / "out")
    index = index_of(out, 0)
    victim = int(index.frame_sample[2]) + 5
    snippet = _payload(out, 0, victim)[:64]
    path = out / "shard-00000.tar.zst"
    data = path.read_bytes()
    cut = data.find(snippet) + 100  # inside the victim's payload
    path.write_bytes(data[:cut])
    with pytest.raises(CorruptShardError, match="zstd frame 2") as info:
        list(ShardDataset(str(out), shuffle=False))
    # what still decodes of frame 2 is checked sample by sample: the first sample not
    # recovered is named. zstd gives a block's output only once the whole block is in,
    # so that is the first sample of the cut block (blocks hold at most 128 KiB).
    named = next(i for i in range(index.num_samples) if index.key(i) == info.value.key)
    assert int(index.frame_sample[2]) <= named <= victim
    assert int(index.sample_offset[victim + 1] - index.sample_offset[named]) <= 128 << 10
    assert info.value.offset == int(index.sample_offset[named])


def test_verify_names_the_damaged_keys(built: Path, tmp_path: Path) -> None:
    out = copy_output(built, tmp_path / "out")
    index = index_of(out, 6)
    for victim in (2, 9):
        _flip(
            out / "shard-00006.tar", int(index.member_offset[int(index.member_start[victim])]) + 1
        )
    report = verify_output(str(out))
    keys = f"{index.key(2)!r} (offset {int(index.sample_offset[2])}), {index.key(9)!r} (offset {int(index.sample_offset[9])})"
    assert report.problems == [
        "shard-00006.tar: sha256 of the shard does not match the manifest (corrupt or modified)",
        f"shard-00006.tar: 2 damaged sample(s) (missing bytes or checksum mismatch): {keys}",
    ]


def test_intact_output_reads_and_verifies_clean(built: Path, built_zstd: Path) -> None:
    for out in (built, built_zstd):
        assert verify_output(str(out)).problems == []
        samples = list(ShardDataset(str(out)))
        assert len(samples) == read_manifest(str(out)).num_samples
        assert not any(s["__padded__"] for s in samples)
    assert np.all(index_of(built, 0).member_hash != 0)


def test_checksums_can_be_turned_off_on_the_reader(built: Path, tmp_path: Path) -> None:
    """The opt-out (ShardReader(checksums=False)) hands the damaged bytes out unchecked."""
    from loader.io.source import Source
    from loader.plan.order import SampleRange
    from loader.read.reader import ShardReader

    out = copy_output(built, tmp_path / "out")
    index = index_of(out, 4)
    offset = int(index.member_offset[int(index.member_start[6])])
    _flip(out / "shard-00004.tar", offset)
    source = Source(str(out))
    piece = SampleRange(4, 0, index.num_samples, False)
    readers = [
        ShardReader(source, source.manifest(), read=ReadOptions(checksums=flag))
        for flag in (True, False)
    ]
    try:
        checked, unchecked = (reader.read(piece) for reader in readers)
    finally:
        for reader in readers:
            reader.close()
    with pytest.raises(CorruptShardError):
        checked.sample(6)
    assert len([unchecked.sample(j) for j in range(len(unchecked))]) == index.num_samples
    intact = ShardDataset(str(built), shuffle=False)
    original = next(s["bin"] for s in intact if s["__key__"] == index.key(6))
    assert unchecked.sample(6)["bin"] != original  # the damaged bytes, handed out


def test_an_index_read_again_after_leaving_the_cache_is_checked_again(
    built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With room for one index only, every shard's index is read again and again: the epoch
    is the same, and an index swapped for another shard's after its first read (each passes
    ``check_index`` on its own) is refused by its sha256, not trusted from the first check."""
    import loader.read.reader
    from loader.io.source import Source
    from loader.plan.order import SampleRange
    from loader.read.reader import ShardReader
    from shardprep.format.errors import ChecksumMismatchError

    expected = [(s["__key__"], s["bin"]) for s in ShardDataset(str(built), seed=3)]
    monkeypatch.setattr(loader.read.reader, "INDEX_CACHE_BYTES", 1)
    assert [(s["__key__"], s["bin"]) for s in ShardDataset(str(built), seed=3)] == expected
    batches = list(ShardDataset(str(built), seed=3, batch_size=5))
    assert [k for b in batches for k in b["__key__"].tolist()] == [k for k, _ in expected]

    out = copy_output(built, tmp_path / "out")
    source = Source(str(out))
    reader = ShardReader(source, source.manifest())
    try:
        first = index_of(out, 0)
        reader.read(SampleRange(0, 0, first.num_samples, False))
        reader.read(SampleRange(1, 0, index_of(out, 1).num_samples, False))  # 0 leaves the cache
        (out / "shard-00000.idx").write_bytes((out / "shard-00001.idx").read_bytes())
        with pytest.raises(ChecksumMismatchError, match="shard-00000.idx"):
            reader.read(SampleRange(0, 0, first.num_samples, False))
    finally:
        reader.close()
