"""Index version 3: one checksum per sample, over its tar headers, padding and data.

A v3 ``sample_hash[i]`` is xxh3_64 of the tar bytes from sample ``i``'s first header to the
end of its last member's data (``member_hash`` stays the data's checksum, as in version 2),
so the one check per sample that the loader makes covers every byte of a sample up to its
last member's data: a flipped byte in a header, in the padding between members or in the
data is refused on the per-sample and the batch path, in process and in a DataLoader
worker, naming the shard, the key, its offset and what is damaged (worked out from the
members' data checksums and the headers once the sample's checksum failed); the separate
header comparison (``damaged_headers``) does not run on reads of a v3 output. Version 2
outputs (no ``sample_hash``, made here by converting a v3 build's indexes) are still read,
and their header damage still caught.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch.utils.data

import loader.read.chunk
from loader import CorruptShardError, ShardDataset
from loader.io.source import Source
from loader.plan.order import SampleRange
from loader.read.reader import ShardReader
from shardprep.format.shardformat import (
    BLOCK,
    ShardIndex,
    encode_index,
    payload_checksum,
    sample_checksums,
    sample_ends,
)
from shardprep.verify import verify_output
from tests.faults.shard_surgery import _update_entry, copy_output, index_of
from tests.faults.test_tar_headers import SHARD, TOTAL, VICTIM, _all_keys, _check_error
from tests.processes import dataloader_iterator

SHARDS = 8  # conftest ``built``


def _as_version_2(out: Path) -> None:
    """Make ``out`` what a version 2 shardprep wrote: data-only checksums, no sample_hash,
    version 2 indexes (the manifest's index sha256 and size follow)."""
    for shard in range(SHARDS):
        index = index_of(out, shard)
        data = (out / f"shard-{shard:05d}.tar").read_bytes()
        arrays = {
            f.name: np.array(getattr(index, f.name))
            for f in dataclasses.fields(ShardIndex)
            if f.name not in ("exts", "version", "sample_hash")
        }
        arrays["member_hash"] = np.array(
            [
                payload_checksum(data[int(a) : int(a) + int(z)])
                for a, z in zip(index.member_offset, index.member_size, strict=True)
            ],
            dtype=np.uint64,
        )
        encoded = encode_index(list(index.exts), arrays, version=2)
        (out / f"shard-{shard:05d}.idx").write_bytes(encoded)
        sha = hashlib.sha256(encoded).hexdigest()
        _update_entry(out, shard, index_sha256=sha, index_bytes=len(encoded))


@pytest.fixture(scope="module")
def built_v2(built: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = copy_output(built, tmp_path_factory.mktemp("v2") / "out")
    _as_version_2(out)
    return out


def _mix(relative: int, size: int) -> int:
    """The layout mix of one member (``shardformat.sample_layout``), in plain integers."""
    full = (1 << 64) - 1
    value = ((relative * 0x9E3779B97F4A7C15) & full) ^ ((size * 0xC2B2AE3D27D4EB4F) & full)
    value ^= value >> 31
    value = (value * 0x165667B19E3779F9) & full
    return value ^ (value >> 29)


def _flip(out: Path, position: int) -> None:
    path = out / f"shard-{SHARD:05d}.tar"
    data = bytearray(path.read_bytes())
    data[position] ^= 0x01
    path.write_bytes(bytes(data))


def _victim(out: Path) -> tuple[ShardIndex, int, str, int]:
    index = index_of(out, SHARD)
    return (
        index,
        int(index.member_start[VICTIM]),
        index.key(VICTIM),
        int(index.sample_offset[VICTIM]),
    )


def _read(out: Path, batch_size: int | None, workers: int) -> list[str]:
    """Keys delivered until the error (the error propagates)."""
    ds = ShardDataset(str(out), batch_size=batch_size, seed=5)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    keys: list[str] = []
    with dataloader_iterator(loader) as items:
        for item in items:
            keys += [item["__key__"]] if batch_size is None else item["__key__"].tolist()
    return keys


def test_a_new_build_writes_version_3_sample_checksums_over_headers_and_padding(
    built: Path,
) -> None:
    for shard in range(SHARDS):
        index = index_of(built, shard)
        data = (built / f"shard-{shard:05d}.tar").read_bytes()
        n = index.num_samples
        assert index.version == 3 and len(index.sample_hash) == n
        start = index.sample_offset[:-1].astype(np.int64)
        end = sample_ends(index, 0, n)
        last = index.member_start[1:].astype(np.int64) - 1  # every sample has members here
        assert end.tolist() == (index.member_offset[last] + index.member_size[last]).tolist()
        assert (end < index.sample_offset[1:].astype(np.int64)).all()  # trailing padding out
        got = [payload_checksum(data[a:b]) for a, b in zip(start, end, strict=True)]
        assert got == sample_checksums(index, 0, n).tolist()
        # stored combined with each sample's member layout (offsets from its start, sizes)
        layout = []
        for i in range(n):
            mixed = 0
            for m in range(int(index.member_start[i]), int(index.member_start[i + 1])):
                mixed ^= _mix(
                    int(index.member_offset[m]) - int(start[i]), int(index.member_size[m])
                )
            layout.append(mixed)
        assert [g ^ x for g, x in zip(got, layout, strict=True)] == index.sample_hash.tolist()
        data_sums = [
            payload_checksum(data[int(a) : int(a) + int(z)])
            for a, z in zip(index.member_offset, index.member_size, strict=True)
        ]
        assert data_sums == index.member_hash.tolist()  # the data only, as in version 2


def test_a_version_2_output_is_read_as_before(built: Path, built_v2: Path) -> None:
    assert {index_of(built_v2, s).version for s in range(SHARDS)} == {2}
    expected = [(s["__key__"], s["bin"], s["cls"]) for s in ShardDataset(str(built), seed=1)]
    got = [(s["__key__"], s["bin"], s["cls"]) for s in ShardDataset(str(built_v2), seed=1)]
    assert got == expected and len(got) == TOTAL
    batches = list(ShardDataset(str(built_v2), seed=1, batch_size=8))
    assert [k for b in batches for k in b["__key__"].tolist()] == [k for k, _, _ in expected]
    assert verify_output(str(built_v2)).problems == []


@pytest.mark.parametrize(("workers", "batch_size"), [(0, None), (0, 8), (1, None), (1, 8)])
def test_a_version_2_header_flip_is_still_caught(
    built_v2: Path, tmp_path: Path, workers: int, batch_size: int | None
) -> None:
    out = copy_output(built_v2, tmp_path / "out")
    index, member, key, offset = _victim(out)
    _flip(out, int(index.member_offset[member]) - BLOCK + 3)  # its name
    with pytest.raises(CorruptShardError) as info:
        _read(out, batch_size, workers)
    _check_error(str(info.value) if workers else info.value, out, key, offset)
    problems = verify_output(str(out)).problems
    assert f"1 damaged sample(s) (missing bytes or checksum mismatch): {key!r}" in "\n".join(
        problems
    )


def test_reading_a_version_3_output_does_not_compare_headers(built: Path, built_v2: Path) -> None:
    """The header comparison runs for a version 2 chunk only (v3 checksums cover headers)."""
    for out, compared in ((built, False), (built_v2, True)):
        source = Source(str(out))
        reader = ShardReader(source, source.manifest())
        try:
            chunk = reader.read(SampleRange(SHARD, 0, index_of(out, SHARD).num_samples, False))
        finally:
            reader.close()
        assert (chunk._bad_headers is not None) is compared, out


def _message_tail(out: Path, key: str, offset: int, reason: str) -> str:
    return (
        f"{out / f'shard-{SHARD:05d}.tar'}: sample {key!r} at offset {offset}: {reason}; run "
        "`shardprep verify` on the output folder and rebuild or restore the shard"
    )


@pytest.mark.parametrize("precheck", [True, False])
@pytest.mark.parametrize("region", ["name", "size", "chksum", "padding", "data", "cls-header"])
@pytest.mark.parametrize(("workers", "batch_size"), [(0, None), (0, 8), (1, None), (1, 8)])
def test_a_version_3_flip_is_refused_naming_what_is_damaged(
    built: Path,
    tmp_path: Path,
    region: str,
    workers: int,
    batch_size: int | None,
    precheck: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``precheck``: these small samples are checked a chunk at once (as they are); else as
    large ones are (each as it is handed out, or per batch), which the DataLoader's forked
    worker inherits."""
    if not precheck:
        monkeypatch.setattr(loader.read.chunk, "PRECHECK_BYTES", 0)
    out = copy_output(built, tmp_path / "out")
    index, member, key, offset = _victim(out)
    data_at, size = int(index.member_offset[member]), int(index.member_size[member])
    cls_data = int(index.member_offset[member + 1])
    assert size % BLOCK  # the .bin member is padded: its padding precedes the .cls header
    position = {
        "name": data_at - BLOCK + 3,
        "size": data_at - BLOCK + 124 + 6,
        "chksum": data_at - BLOCK + 148 + 2,
        "padding": data_at + size + 5,
        "data": data_at + size // 2,
        "cls-header": cls_data - BLOCK + 3,
    }[region]
    _flip(out, position)
    with pytest.raises(CorruptShardError) as info:
        _read(out, batch_size, workers)
    text = str(info.value).splitlines()[-1]
    if region in ("name", "size", "chksum"):
        _check_error(text if workers else info.value, out, key, offset)
    elif region == "cls-header":
        assert text.endswith(
            _message_tail(
                out,
                key,
                offset,
                f"the tar header of its .cls member (at offset {cls_data - BLOCK}) is not the one "
                f"the index describes (a regular file '{key}.cls' of 1 bytes): the shard's bytes "
                "are damaged (tar, tarfile and webdataset would misread or refuse this member)",
            )
        ), text
    elif region == "padding":
        assert text.endswith(
            _message_tail(
                out,
                key,
                offset,
                f"the zero padding before its .cls member's tar header (offset {data_at + size}) "
                "is not zeros: the shard's bytes are damaged",
            )
        ), text
    else:
        damaged = bytearray((out / f"shard-{SHARD:05d}.tar").read_bytes())
        got = payload_checksum(damaged[data_at : data_at + size])
        assert text.endswith(
            _message_tail(
                out,
                key,
                offset,
                f"checksum mismatch in its .bin member (the {size} bytes at offset {data_at} "
                f"hash to {got:#018x}, the index recorded {int(index.member_hash[member]):#018x})"
                ": the shard's bytes are damaged",
            )
        ), text
    if not workers:
        assert (info.value.shard, info.value.key, info.value.offset) == (
            str(out / f"shard-{SHARD:05d}.tar"),
            key,
            offset,
        )


def test_verify_names_a_version_3_header_and_padding_flip(built: Path, tmp_path: Path) -> None:
    for k, region in enumerate(("header", "padding")):
        out = copy_output(built, tmp_path / f"out{k}")
        index, member, key, _ = _victim(out)
        data_at, size = int(index.member_offset[member]), int(index.member_size[member])
        _flip(out, data_at - BLOCK + 3 if region == "header" else data_at + size + 5)
        problems = "\n".join(verify_output(str(out)).problems)
        assert f"1 damaged sample(s) (missing bytes or checksum mismatch): {key!r}" in problems
        assert sorted(_all_keys(out)) == sorted(_all_keys(built))
