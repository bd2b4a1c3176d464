"""Issue 23: a damaged tar header between members is an error, not silently served.

The loader reads members by the index and checks each member's data by its checksum; the tar
headers between them (which ``tar``, ``tarfile`` and WebDataset read) are compared with the
ones the writer makes from the index. A byte flipped in a header's name, size or checksum
field is refused on the per-sample and on the batch path, in process and in a DataLoader
worker, naming the shard, the sample's key and its offset; ``on_error="skip"`` stands in for
exactly that sample; ``checksums=False`` skips this check as it skips the member checks.
"""

from __future__ import annotations

import io
import random
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.utils.data

from loader import CorruptShardError, ReadOptions, ShardDataset
from shardprep.format.integrity import _expected_headers, _ext_words, _key_words, damaged_headers
from shardprep.format.shardformat import BLOCK, tar_header
from tests.faults.shard_surgery import copy_output, index_of
from tests.processes import dataloader_iterator

TOTAL = 103  # conftest ``built``: 60/30/13 samples in 8 plain shards
SHARD, VICTIM = 4, 6
FIELDS = {"name": 3, "size": 124 + 6, "chksum": 148 + 2}  # a byte inside each header field


def _all_keys(out: Path) -> list[str]:
    keys = []
    for shard in range(8):
        index = index_of(out, shard)
        keys += [index.key(i) for i in range(index.num_samples)]
    return keys


def _damage_header(built: Path, tmp_path: Path, field: str) -> tuple[Path, str, int]:
    """A copy of ``built`` with one byte of sample VICTIM's first header flipped: (out, key,
    the sample's offset). The manifest's sha256 is left as is: only ``verify`` reads it."""
    out = copy_output(built, tmp_path / "out")
    index = index_of(out, SHARD)
    member = int(index.member_start[VICTIM])
    header = int(index.member_offset[member]) - BLOCK
    path = out / f"shard-{SHARD:05d}.tar"
    data = bytearray(path.read_bytes())
    assert data[header : header + BLOCK] == tar_header(
        f"{index.key(VICTIM)}.{index.exts[int(index.member_ext[member])]}".encode(),
        int(index.member_size[member]),
    )
    data[header + FIELDS[field]] ^= 0x01  # '0' <-> '1', 'a' <-> '`': still a plausible header
    path.write_bytes(bytes(data))
    return out, index.key(VICTIM), int(index.sample_offset[VICTIM])


def _check_error(err: CorruptShardError | str, out: Path, key: str, offset: int) -> None:
    text = str(err).splitlines()[-1]  # from a worker: its traceback, then the message
    shard = str(out / f"shard-{SHARD:05d}.tar")
    assert text.endswith(
        f"{shard}: sample {key!r} at offset {offset}: the tar header of its .bin member "
        f"(at offset {offset}) is not the one the index describes (a regular file "
        f"'{key}.bin' of {_size(out, key)} bytes): the shard's bytes are damaged (tar, "
        "tarfile and webdataset would misread or refuse this member); run `shardprep verify` "
        "on the output folder and rebuild or restore the shard"
    ), text
    if isinstance(err, CorruptShardError):
        assert (err.shard, err.key, err.offset) == (shard, key, offset)


def _size(out: Path, key: str) -> int:
    index = index_of(out, SHARD)
    return int(index.member_size[int(index.member_start[VICTIM])])


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_the_damage_is_real_for_tarfile(built: Path, tmp_path: Path, field: str) -> None:
    """What the loader must refuse: tarfile reads the damaged shard wrong or not at all."""
    out, key, _ = _damage_header(built, tmp_path, field)
    data = (out / f"shard-{SHARD:05d}.tar").read_bytes()
    try:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            members = [(m.name, m.size) for m in tar.getmembers()]
    except tarfile.TarError:
        return  # refused (the ustar checksum no longer matches)
    index = index_of(out, SHARD)
    intact = [
        (f"{index.key(i)}.{index.exts[int(index.member_ext[m])]}", int(index.member_size[m]))
        for i in range(index.num_samples)
        for m in range(int(index.member_start[i]), int(index.member_start[i + 1]))
    ]
    assert members != intact


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_per_sample_path_names_the_shard_key_and_offset(
    built: Path, tmp_path: Path, field: str
) -> None:
    out, key, offset = _damage_header(built, tmp_path, field)
    delivered = []
    with pytest.raises(CorruptShardError) as info:
        for sample in ShardDataset(str(out), shuffle=False):
            delivered.append(sample["__key__"])
    _check_error(info.value, out, key, offset)
    # every sample before the damaged one came out, and nothing after it
    assert delivered == _all_keys(out)[: _all_keys(out).index(key)]


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_batch_path_raises_what_the_per_sample_path_raises(
    built: Path, tmp_path: Path, field: str
) -> None:
    out, key, offset = _damage_header(built, tmp_path, field)
    # shuffled windows of 40 samples: batches cut across windows (``Window.carry``) too
    for batch_size, window in ((8, 10_000), (16, 40), (5, 7)):
        delivered = []
        ds = ShardDataset(str(out), batch_size=batch_size, shuffle_buffer=window, seed=3)
        with pytest.raises(CorruptShardError) as info:
            for batch in ds:
                delivered += batch["__key__"].tolist()
        _check_error(info.value, out, key, offset)
        assert key not in delivered


@pytest.mark.parametrize("batch_size", [None, 8])
def test_in_a_dataloader_worker(built: Path, tmp_path: Path, batch_size: int | None) -> None:
    out, key, offset = _damage_header(built, tmp_path, "name")
    ds = ShardDataset(str(out), batch_size=batch_size, seed=5)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1)
    with pytest.raises(CorruptShardError) as info, dataloader_iterator(loader) as items:
        list(items)
    _check_error(str(info.value), out, key, offset)


def _samples(ds: ShardDataset, workers: int) -> list[dict[str, Any]]:
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    if ds.batch_size is None:
        return list(loader)
    return [
        {"__key__": k, "__padded__": bool(p)}
        for batch in loader
        for k, p in zip(batch["__key__"].tolist(), batch["__padded__"].tolist(), strict=True)
    ]


@pytest.mark.parametrize("field", sorted(FIELDS))
@pytest.mark.parametrize(("workers", "batch_size"), [(0, None), (0, 8), (1, None), (1, 8)])
def test_skip_stands_in_for_exactly_the_damaged_sample(
    built: Path, tmp_path: Path, field: str, workers: int, batch_size: int | None
) -> None:
    out, key, _ = _damage_header(built, tmp_path, field)
    ds = ShardDataset(str(out), batch_size=batch_size, seed=9, read=ReadOptions(on_error="skip"))
    samples = _samples(ds, workers)
    assert len(samples) == TOTAL
    assert sum(s["__padded__"] for s in samples) == 1
    real = [s["__key__"] for s in samples if not s["__padded__"]]
    assert sorted(real) == sorted(k for k in _all_keys(out) if k != key)


def test_checksums_off_skips_the_header_check_too(built: Path, tmp_path: Path) -> None:
    out, key, _ = _damage_header(built, tmp_path, "size")
    for batch_size in (None, 8):
        ds = ShardDataset(str(out), batch_size=batch_size, read=ReadOptions(checksums=False))
        samples = _samples(ds, 0)
        assert sorted(s["__key__"] for s in samples) == sorted(_all_keys(out))
        assert not any(s["__padded__"] for s in samples)


def test_intact_shards_have_no_damaged_header(built: Path) -> None:
    for shard in range(8):
        index = index_of(built, shard)
        data = (built / f"shard-{shard:05d}.tar").read_bytes()
        n = index.num_samples
        assert damaged_headers(index, data, 0, 0, n).tolist() == []
        if n > 3:  # a range from inside the shard, its bytes from its first sample
            base = int(index.sample_offset[2])
            part = data[base : int(index.sample_offset[n - 1])]
            assert damaged_headers(index, part, base, 2, n - 1).tolist() == []


def test_every_byte_of_a_header_is_checked(built: Path) -> None:
    index = index_of(built, 0)
    data = (built / "shard-00000.tar").read_bytes()
    n = index.num_samples
    member = int(index.member_start[n // 2]) + 1  # a .cls member's header
    header = int(index.member_offset[member]) - BLOCK
    for position in range(BLOCK):
        damaged = bytearray(data)
        damaged[header + position] ^= 0x80
        assert damaged_headers(index, bytes(damaged), 0, 0, n).tolist() == [member], position


def test_expected_headers_are_the_writers_bytes() -> None:
    """The vectorised headers against ``tar_header`` for keys, extensions and sizes of every
    width the usual path takes (names up to 100 bytes, sizes up to 8 GiB - 1)."""
    rng = random.Random(7)
    exts = ("jpg", "cls", "seg.png", "x" * 40)
    alphabet = "abcXYZ019_-"
    keys = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 59))) for _ in range(300)]
    keys += ["k" * 59, "é" * 29]  # the longest name with the longest extension; UTF-8
    blob = np.frombuffer("".join(keys).encode(), dtype=np.uint8)
    key_len = np.array([len(k.encode()) for k in keys], dtype=np.int64)
    sizes = [0, 1, 511, 512, 513, 0o7, 0o10, 0o7777, 0o10000, 0o77777777777, 2**32 + 5]
    owner = np.arange(len(keys) * 3) % len(keys)
    ext = np.array([rng.randrange(len(exts)) for _ in owner], dtype=np.int64)
    size = np.array(
        [sizes[i % len(sizes)] if i % 2 else rng.randrange(2**33) for i in range(len(owner))],
        dtype=np.int64,
    )
    ext_words = _ext_words(exts)
    tables = (*_key_words(blob, key_len, np.cumsum(key_len) - key_len), *ext_words)
    count = len(owner)
    expected = np.empty((count, BLOCK // 8), dtype=np.uint64)
    expected[:] = np.frombuffer(tar_header(b"", 0), dtype=np.uint64)
    names = np.empty((count, 13), dtype=np.uint64)
    _expected_headers(expected, names, tables, key_len[owner], owner, ext, size)
    made = expected.tobytes()
    for i in range(count):
        name = f"{keys[owner[i]]}.{exts[ext[i]]}".encode()
        assert made[i * BLOCK : (i + 1) * BLOCK] == tar_header(name, int(size[i])), (name, size[i])


def test_long_names_are_checked_one_by_one(tmp_path: Path) -> None:
    """A member name over 100 bytes has a GNU long-name record before its header: checked too."""
    import shardprep
    from tests.faults.helpers import write

    raw = tmp_path / "raw"
    long_key = "n" * 120
    write(raw / "a" / f"{long_key}.bin", b"x" * 700)
    write(raw / "a" / "short.bin", b"y" * 10)
    write(raw / "b" / "other.bin", b"z" * 1000)
    shardprep.build(str(raw), str(tmp_path / "out"), shards=1, workers=1, progress=False)
    out = tmp_path / "out"
    index = index_of(out, 0)
    data = (out / "shard-00000.tar").read_bytes()
    n = index.num_samples
    assert damaged_headers(index, data, 0, 0, n).tolist() == []
    victim = next(i for i in range(n) if long_key in index.key(i))
    member = int(index.member_start[victim])
    name = f"{index.key(victim)}.bin".encode()
    records = tar_header(name, int(index.member_size[member]))
    assert len(records) == 3 * BLOCK  # the long-name header, the name, the member's header
    first = int(index.member_offset[member]) - len(records)
    for position in (5, BLOCK + 7, 2 * BLOCK + 124 + 4):  # each of the three records
        damaged = bytearray(data)
        damaged[first + position] ^= 0x01
        assert damaged_headers(index, bytes(damaged), 0, 0, n).tolist() == [member]
    # and through the loader
    damaged = bytearray(data)
    damaged[first + BLOCK + 7] ^= 0x01
    (out / "shard-00000.tar").write_bytes(bytes(damaged))
    with pytest.raises(CorruptShardError, match="the tar header of its .bin member") as info:
        list(ShardDataset(str(out), shuffle=False))
    assert info.value.key == index.key(victim)
