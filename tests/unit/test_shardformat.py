"""The on-disk contract: tar headers (vs Python's tarfile), file names, the sidecar index."""

from __future__ import annotations

import dataclasses
import io
import json
import struct
import tarfile

import numpy as np
import pytest

from shardprep.format.errors import ManifestError
from shardprep.format.shardformat import (
    BLOCK,
    EOF_MARKER,
    INDEX_MAGIC,
    ShardIndex,
    decode_index,
    encode_index,
    index_name,
    padding,
    shard_name,
    tar_header,
)

MAX_OCTAL = 0o77777777777  # 8 GiB - 1: the largest size in 11 octal digits


def _tarfile_ustar(name: bytes, size: int) -> bytes:
    info = tarfile.TarInfo(name.decode("utf-8", "surrogateescape"))
    info.size, info.mode, info.mtime, info.uid, info.gid = size, 0o644, 0, 0, 0
    info.uname = info.gname = ""
    return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")


def _checksum_ok(header: bytes) -> bool:
    stored = int(header[148:154], 8)
    assert header[154:156] == b"\x00 "
    return stored == sum(header[:148]) + 8 * ord(" ") + sum(header[156:512])


def _tar(members: list[tuple[bytes, bytes]]) -> bytes:
    out = bytearray()
    for name, data in members:
        out += tar_header(name, len(data)) + data + padding(len(data))
    return bytes(out + EOF_MARKER)


# --- tar headers ------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 511, 512, 513, 123_456_789, MAX_OCTAL])
@pytest.mark.parametrize("name", [b"a.bin", b"0001.seg.png", b"k" * 96 + b".jpg", b"n" * 100])
def test_short_name_header_matches_tarfile_ustar(name: bytes, size: int) -> None:
    ours = tar_header(name, size)
    ref = _tarfile_ustar(name, size)
    assert len(ours) == BLOCK
    # Identical to tarfile's ustar header except devmajor/devminor, which we write as
    # octal zeros and tarfile leaves empty for regular files (both read as 0), and so
    # the checksum over them.
    assert ours[:148] == ref[:148]
    assert ours[156:329] == ref[156:329]
    assert ours[329:345] == b"0000000\x00" * 2
    assert ref[329:345] == bytes(16)
    assert ours[345:] == ref[345:]
    assert _checksum_ok(ours)
    info = tarfile.TarInfo.frombuf(ours, "utf-8", "surrogateescape")  # validates the checksum
    assert (info.name, info.size, info.mode, info.mtime) == (name.decode(), size, 0o644, 0)
    assert (info.uid, info.gid, info.uname, info.gname) == (0, 0, "", "")
    assert info.type == tarfile.REGTYPE
    assert (info.devmajor, info.devminor) == (0, 0)


@pytest.mark.parametrize(
    ("name", "records"),
    [
        (b"n" * 101, 3),
        (b"deep__" * 30 + b"x.jpg", 3),  # 185 bytes
        (b"k" * 99 + "é".encode(), 3),  # 101 bytes, 100 characters
        (b"k" * 511, 3),  # long name + NUL exactly fills one block
        (b"k" * 512 + b".bin", 4),  # long name spills into a second block
    ],
)
def test_long_name_uses_a_gnu_longlink_record(name: bytes, records: int) -> None:
    header = tar_header(name, 513)
    assert len(header) == records * BLOCK
    assert header[:13] == b"././@LongLink"
    assert header[156:157] == b"L"
    assert _checksum_ok(header[:BLOCK])
    assert _checksum_ok(header[-BLOCK:])
    assert header[-BLOCK:][:100] == name[:100]  # the regular record holds the truncated name
    assert tarfile.TarInfo.frombuf(header[:BLOCK], "utf-8", "surrogateescape").size == len(name) + 1


def test_tarfile_reads_names_sizes_and_data() -> None:
    members = [
        (b"a.bin", b""),
        (b"b.bin", bytes(range(256)) * 2 + b"x" * 255),  # 767
        (b"c.bin", b"\x01" * 511),
        (b"d.bin", b"\x02" * 512),
        (b"e.bin", b"\x03" * 513),
        (b"n" * 100 + b"", b"exactly 100"),
        (b"L" * 150 + b".txt", b"long name"),
        (b"x" * 99 + "é".encode() + b".bin", b"utf-8 long name"),
        (b"k" * 700 + b".bin", b"very long name" * 100),
    ]
    data = _tar(members)
    assert len(data) % BLOCK == 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        got = [(m.name, m.size, m.isfile(), tar.extractfile(m).read()) for m in tar]
    assert got == [(n.decode(), len(d), True, d) for n, d in members]
    # stream mode (as WebDataset reads) sees the same
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tar:
        assert [(m.name, m.size) for m in tar] == [(n.decode(), len(d)) for n, d in members]


def test_data_offsets_follow_the_headers() -> None:
    members = [(b"a.bin", b"A" * 513), (b"L" * 200 + b".bin", b"B" * 3), (b"c.bin", b"")]
    data = _tar(members)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        offsets = [(m.offset, m.offset_data) for m in tar]
    # header 512 + 1024 data; longlink 512 + name block 512 + header 512 + 512 data; header 512
    assert offsets == [(0, 512), (1536, 3072), (3584, 4096)]


@pytest.mark.parametrize("size", [MAX_OCTAL + 1, 2**33 + 123, 2**40 + 7, 2**62])
def test_big_size_uses_base256(size: int) -> None:
    header = tar_header(b"big.bin", size)
    field = header[124:136]
    assert field[0] == 0x80
    assert int.from_bytes(field[1:], "big") == size
    assert _checksum_ok(header)
    info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
    assert info.size == size
    # tarfile's GNU writer encodes the size field the same way
    ref = tarfile.TarInfo("big.bin")
    ref.size, ref.mtime, ref.mode = size, 0, 0o644
    assert ref.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")[124:136] == field


def test_largest_octal_size_stays_octal() -> None:
    assert tar_header(b"a", MAX_OCTAL)[124:136] == b"77777777777\x00"
    assert tar_header(b"a", 0)[124:136] == b"00000000000\x00"
    assert tar_header(b"a", 513)[124:136] == b"00000001001\x00"


def test_headers_are_deterministic() -> None:
    assert tar_header(b"x" * 300, 77) == tar_header(b"x" * 300, 77)
    assert tar_header(b"a.b", 1) != tar_header(b"a.c", 1)


@pytest.mark.parametrize(
    ("size", "pad"), [(0, 0), (1, 511), (511, 1), (512, 0), (513, 511), (1024, 0)]
)
def test_padding(size: int, pad: int) -> None:
    assert padding(size) == bytes(pad)


def test_eof_marker_is_two_zero_blocks() -> None:
    assert len(EOF_MARKER) == 1024
    assert not any(EOF_MARKER)


def test_file_names() -> None:
    assert shard_name(7, "none") == "shard-00007.tar"
    assert shard_name(7, "zstd") == "shard-00007.tar.zst"
    assert shard_name(12345, "none") == "shard-12345.tar"
    assert index_name(0) == "shard-00000.idx"
    assert index_name(99999) == "shard-99999.idx"


# --- sidecar index ----------------------------------------------------------------

KEYS = ["a__00001", "k", "b__x-y_z"]
SOURCES = ["a/00001.jpg", "k.seg.png", "b/x-y z.\udcff.jpg"]  # one undecodable byte


def _arrays(frames: bool) -> dict[str, object]:
    key_blob = "".join(KEYS).encode()
    source_blob = b"".join(s.encode("utf-8", "surrogateescape") for s in SOURCES)
    return {
        "sample_offset": [0, 2048, 5120, 8192],
        "member_start": [0, 2, 3, 5],
        "member_ext": [0, 1, 2, 0, 1],
        "member_offset": [512, 1536, 2560, 5632, 7168],
        "member_size": [10, 1, 300, 1000, 1],
        "member_hash": np.array([0, 2**64 - 1, 12345678901234567890, 7, 1 << 63], dtype=np.uint64),
        "sample_hash": np.array([2**64 - 2, 5, 1 << 62], dtype=np.uint64),
        "label": [2, -1, 0] if not frames else [0, 1, 70000],
        "copy": [0, 0, 3],
        "multiplicity": [1, 1, 4],
        "key_end": np.cumsum([len(k) for k in KEYS]),
        "source_end": np.cumsum([len(s.encode("utf-8", "surrogateescape")) for s in SOURCES]),
        "frame_sample": [0, 2, 3] if frames else [],
        "frame_offset": [0, 900, 1500] if frames else [],
        "key_blob": np.frombuffer(key_blob, dtype=np.uint8),
        "source_blob": np.frombuffer(source_blob, dtype=np.uint8),
    }


@pytest.mark.parametrize("frames", [False, True])
def test_index_round_trip(frames: bool) -> None:
    exts = ["jpg", "cls", "seg.png"]
    arrays = _arrays(frames)
    data = encode_index(exts, arrays)
    assert data[:8] == INDEX_MAGIC
    assert len(data) % 8 == 0
    index = decode_index(data)
    assert isinstance(index, ShardIndex)
    assert index.exts == tuple(exts)
    assert index.num_samples == 3
    expected_dtypes = {
        "sample_offset": np.uint64,
        "member_start": np.uint64,
        "member_ext": np.uint16,
        "member_offset": np.uint64,
        "member_size": np.uint64,
        "member_hash": np.uint64,
        "sample_hash": np.uint64,
        "label": np.int32,
        "copy": np.uint32,
        "multiplicity": np.uint32,
        "key_end": np.uint64,
        "source_end": np.uint64,
        "frame_sample": np.uint64,
        "frame_offset": np.uint64,
        "key_blob": np.uint8,
        "source_blob": np.uint8,
    }
    # every array of the format is covered here
    assert {f.name for f in dataclasses.fields(ShardIndex)} == {
        "exts",
        "version",
        *expected_dtypes,
    }
    assert index.version == 3
    for name, dtype in expected_dtypes.items():
        got = getattr(index, name)
        assert got.dtype == np.dtype(dtype), name
        assert np.array_equal(got, np.asarray(arrays[name]).astype(dtype)), name
    assert [index.key(i) for i in range(3)] == KEYS
    assert [index.source(i) for i in range(3)] == SOURCES
    # re-encoding the decoded arrays gives the same bytes
    fields = {name: getattr(index, name) for name in expected_dtypes}
    assert encode_index(list(index.exts), fields) == data


def test_index_header_is_sorted_json_with_version() -> None:
    data = encode_index(["jpg"], _arrays(False))
    (head_len,) = struct.unpack_from("<Q", data, 8)
    assert head_len % 8 == 0
    header = json.loads(data[16 : 16 + head_len])
    assert header["format"] == "shardprep-index"
    assert header["version"] == 3  # 3: sample_hash (headers, padding, data); 2: none
    assert header["arrays"]["label"][0] == "<i4"
    assert header["arrays"]["member_hash"][0] == "<u8"
    assert header["arrays"]["sample_hash"][0] == "<u8"
    assert header["arrays"]["sample_offset"][1] == 0  # first array right after the header
    for _dtype, offset, _length in header["arrays"].values():
        assert offset % 8 == 0


def test_empty_index_round_trip() -> None:
    empty = {name: [] for name in _arrays(False)}
    empty["sample_offset"] = [0]
    empty["member_start"] = [0]
    index = decode_index(encode_index([], empty))
    assert index.num_samples == 0
    assert index.exts == ()
    assert index.sample_offset.tolist() == [0]


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"SHPIDX",
        INDEX_MAGIC,  # magic only
        INDEX_MAGIC + b"\x00" * 7,  # 15 bytes
        b"SHPIDX\x00\x02" + bytes(64),  # other version in the magic
        b"\x00" * 64,
        b"PK\x03\x04" + bytes(60),
    ],
)
def test_decode_rejects_bad_magic(data: bytes) -> None:
    with pytest.raises(ManifestError) as info:
        decode_index(data, "some/shard-00003.idx")
    assert "some/shard-00003.idx" in str(info.value)
    assert info.value.path == "some/shard-00003.idx"


def test_decode_rejects_every_truncation() -> None:
    data = encode_index(["jpg", "cls", "seg.png"], _arrays(True))
    (head_len,) = struct.unpack_from("<Q", data, 8)
    header = json.loads(data[16 : 16 + head_len])
    needed = 16 + head_len + max(off + length for _d, off, length in header["arrays"].values())
    assert needed > len(data) - 8  # only the last array's alignment padding is optional
    for cut in range(needed):
        with pytest.raises(ManifestError, match="x.idx"):
            decode_index(data[:cut], "x.idx")
    decode_index(data[:needed], "x.idx")  # the padding after the last array may go


def _with_header(data: bytes, edit: object) -> bytes:
    (head_len,) = struct.unpack_from("<Q", data, 8)
    header = json.loads(data[16 : 16 + head_len])
    edit(header)  # type: ignore[operator]
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return INDEX_MAGIC + struct.pack("<Q", len(head)) + head + data[16 + head_len :]


def test_decode_rejects_corrupt_headers() -> None:
    data = encode_index(["jpg"], _arrays(False))
    assert decode_index(_with_header(data, lambda h: None)).num_samples == 3  # sanity

    def wrong_dtype(h: dict) -> None:
        h["arrays"]["label"][0] = "<i8"

    def missing_array(h: dict) -> None:
        del h["arrays"]["copy"]

    def missing_exts(h: dict) -> None:
        del h["exts"]

    def past_the_end(h: dict) -> None:
        h["arrays"]["source_blob"][2] += 8

    for edit in (wrong_dtype, missing_array, missing_exts, past_the_end):
        with pytest.raises(ManifestError, match="corrupt shard index"):
            decode_index(_with_header(data, edit), "y.idx")
    # garbage where the JSON header should be
    broken = data[:16] + b"#" + data[17:]
    with pytest.raises(ManifestError, match="y.idx"):
        decode_index(broken, "y.idx")
    # a header length beyond the data
    huge = INDEX_MAGIC + struct.pack("<Q", 1 << 40) + data[16:]
    with pytest.raises(ManifestError):
        decode_index(huge, "y.idx")


def test_version_2_is_read_and_others_refused() -> None:
    """Version 2 (data-only checksums) is still read and says so; 1 and 4 are refused."""
    from shardprep.format.errors import ManifestError

    index = decode_index(encode_index(["jpg"], _arrays(False), version=2))
    assert index.version == 2
    assert decode_index(encode_index(["jpg"], _arrays(False))).version == 3
    for version in (1, 4, "3"):
        data = encode_index(["jpg"], _arrays(False), version=version)  # type: ignore[arg-type]
        with pytest.raises(ManifestError, match=f"index format version {version!r} is not one"):
            decode_index(data, "x.idx")


def test_a_version_2_index_has_no_sample_hash() -> None:
    """Version 2 indexes are written and read without ``sample_hash`` (empty when read)."""
    arrays = _arrays(False)
    data = encode_index(["jpg", "cls", "seg.png"], arrays, version=2)
    (head_len,) = struct.unpack_from("<Q", data, 8)
    assert "sample_hash" not in json.loads(data[16 : 16 + head_len])["arrays"]
    v2 = decode_index(data)
    assert v2.version == 2 and v2.sample_hash.tolist() == [] and v2.sample_hash.dtype == np.uint64
    assert v2.member_hash.tolist() == np.asarray(arrays["member_hash"]).tolist()
    del arrays["sample_hash"]  # not needed for version 2
    assert encode_index(["jpg", "cls", "seg.png"], arrays, version=2) == data


def test_sample_ends_are_each_samples_last_data_end() -> None:
    """A sample's hashed bytes end where its last member's data ends (not its padding)."""
    from shardprep.format.shardformat import sample_ends

    v3 = decode_index(encode_index(["jpg", "cls", "seg.png"], _arrays(False)))
    assert sample_ends(v3, 0, 3).tolist() == [1537, 2860, 7169]
    assert sample_ends(v3, 1, 3).tolist() == [2860, 7169]
    assert sample_ends(v3, 2, 2).tolist() == []
    arrays = _arrays(False)
    arrays["member_start"] = [0, 2, 2, 5]  # sample 1 without members: it ends at its start
    odd = decode_index(encode_index(["jpg", "cls", "seg.png"], arrays))
    assert sample_ends(odd, 0, 3).tolist() == [1537, 2048, 7169]
