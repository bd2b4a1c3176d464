"""The on-disk contract: shard and index file names, tar member layout, index layout.

This is the only module that knows how bytes are laid out on disk; the writer
(``shardprep.write``) and the reader (``loader.read.reader``) both import it.
``docs/format.md`` documents the same layout field by field.

Tar members are written as POSIX ustar headers with fixed metadata (mode 0644,
uid/gid 0, empty user/group names, mtime 0), so the same samples always give the
same bytes. A name longer than 100 bytes is preceded by a GNU ``././@LongLink``
record, which GNU tar, Python's ``tarfile`` and WebDataset all read.

The sidecar index (``shard-NNNNN.idx``) holds, per sample, the byte offset of
its first header, the data offset, size and extension of every member, its
label, key, source path and resampling copy number, and for ``.tar.zst`` shards
the table of independent zstd frames. A reader can thus start at any sample
without parsing tar headers or decompressing from the start of the shard.

Every member of every sample has a checksum of its data in the index
(``member_hash``), and since index version 3 every sample has one more
(``sample_hash``) of its tar bytes from its first header to the end of its last
member's data: every header record, every padding between its members and every
data byte (:func:`sample_ends`), combined with the sample's member layout as the
index records it (:func:`sample_checksums`: an index that lies about where a
member ends inside its padding fails it too). A reader checks ``sample_hash`` only
(one checksum per sample); ``member_hash`` says which member's data is damaged
once it fails.
Version 2 indexes (still read) have no ``sample_hash``. :func:`payload_checksum`
is the hash.

A sample as the loader hands it out is a dict of its members by extension plus fields the
loader sets itself (:data:`LOADER_FIELDS`: ``__key__``, ``__padded__``...). A member whose
extension is a dunder name (:func:`reserved_member`) would stand in for such a field, so the
builder refuses one at scan on every input path and an index that names one is refused by
the reader and ``shardprep verify`` (``shardprep.format.integrity.check_index``). A build
holds at most :data:`MAX_EXTENSIONS` distinct member extensions (``member_ext`` is uint16).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

__all__ = [
    "BLOCK",
    "KEY_FIELD",
    "LOADER_FIELDS",
    "MAX_EXTENSIONS",
    "PADDED_FIELD",
    "POSITION_FIELD",
    "SOURCE_FIELD",
    "WEIGHT_FIELD",
    "reserved_member",
    "CHECKSUM_ALGORITHM",
    "EOF_MARKER",
    "FRAME_BYTES",
    "INDEX_MAGIC",
    "INDEX_VERSION",
    "MANIFEST_NAME",
    "ShardIndex",
    "decode_index",
    "READ_VERSIONS",
    "encode_index",
    "mismatched",
    "sample_checksums",
    "sample_ends",
    "sample_layout",
    "index_name",
    "padding",
    "payload_checksum",
    "shard_name",
    "tar_header",
    "V3_ONLY",
]

BLOCK = 512
EOF_MARKER = bytes(2 * BLOCK)
MANIFEST_NAME = "manifest.json"
INDEX_MAGIC = b"SHPIDX\x00\x01"
INDEX_VERSION = 3
"""Written by this shardprep: ``sample_hash`` covers each sample's headers, padding and data."""
READ_VERSIONS = (2, 3)
"""Index versions this shardprep reads (2: no ``sample_hash``, the headers are compared)."""
FRAME_BYTES = 256 << 10
"""A .tar.zst frame is closed once it holds this many tar bytes (whole samples only)."""
CHECKSUM_ALGORITHM = "xxh3_64"

KEY_FIELD = "__key__"
"""The sample's key, in every sample and batch the loader hands out."""
PADDED_FIELD = "__padded__"
"""True for a repeat that pads a rank's share (``drop_last=False`` with ``"pad"``)."""
WEIGHT_FIELD = "__weight__"
"""A reweighted sample's weight (target share / actual share of its class)."""
POSITION_FIELD = "__position__"
"""Where a batch sits in its epoch (batches only)."""
SOURCE_FIELD = "__source__"
"""The index of the source a mixed sample came from."""
LOADER_FIELDS = (KEY_FIELD, PADDED_FIELD, WEIGHT_FIELD, POSITION_FIELD, SOURCE_FIELD)
"""Every field the loader sets in a sample or batch itself: no member may be named so."""
MAX_EXTENSIONS = 1 << 16
"""Distinct member extensions one build (and one shard index) can hold: ``member_ext`` is a
uint16."""


def reserved_member(ext: str) -> bool:
    """True if a member with extension ``ext`` cannot be written: a dunder name (``__key__``,
    ``__padded__``, WebDataset's ``__url__``...), the shape of every field in
    :data:`LOADER_FIELDS`, which the member would stand in for in the loader's samples."""
    return len(ext) > 4 and ext.startswith("__") and ext.endswith("__") and "." not in ext


payload_checksum = xxhash.xxh3_64_intdigest
"""``payload_checksum(data) -> int``: the checksum (xxh3_64, seed 0, as an unsigned 64-bit
integer) stored in ``member_hash`` (of a member's data) and ``sample_hash`` (of a sample's
tar bytes, :func:`sample_ends`); accepts any buffer."""


def shard_name(index: int, compression: str) -> str:
    """File name of shard ``index``: ``shard-00007.tar`` or ``shard-00007.tar.zst``."""
    return f"shard-{index:05d}.tar" + (".zst" if compression == "zstd" else "")


def index_name(index: int) -> str:
    """File name of the sidecar index of shard ``index``."""
    return f"shard-{index:05d}.idx"


# --- tar headers ---------------------------------------------------------------
# A ustar header is 512 bytes: name[100] mode[8] uid[8] gid[8] size[12] mtime[12]
# chksum[8] typeflag[1] linkname[100] magic[6] version[2] uname[32] gname[32]
# devmajor[8] devminor[8] prefix[155] pad[12]. Only name, size and the checksum
# vary between our members, so the rest is precomputed once.
_MODE_UID_GID = b"0000644\x00" + b"0000000\x00" + b"0000000\x00"
_MTIME = b"00000000000\x00"
_TAIL_REGULAR = (
    b"0"  # typeflag: regular file
    + bytes(100)  # linkname
    + b"ustar\x0000"  # magic + version (POSIX)
    + bytes(32 + 32)  # uname, gname
    + b"0000000\x00" * 2  # devmajor, devminor
    + bytes(155 + 12)  # prefix, pad
)
_TAIL_LONGNAME = b"L" + _TAIL_REGULAR[1:]
_CHKSUM_BLANK = b" " * 8
_FIXED_SUM = sum(_MODE_UID_GID) + sum(_MTIME) + sum(_CHKSUM_BLANK)
_SUM_REGULAR = _FIXED_SUM + sum(_TAIL_REGULAR)
_SUM_LONGNAME = _FIXED_SUM + sum(_TAIL_LONGNAME)
_LONGLINK = b"././@LongLink"
_MAX_OCTAL_SIZE = 0o77777777777  # 8 GiB - 1 fits 11 octal digits


def _size_field(size: int) -> bytes:
    if size <= _MAX_OCTAL_SIZE:
        return b"%011o\x00" % size
    # GNU base-256: high bit set, big-endian binary (tarfile and GNU tar read it).
    return b"\x80" + size.to_bytes(11, "big")


def _one_header(name: bytes, size: int, tail: bytes, tail_sum: int) -> bytes:
    size_field = _size_field(size)
    checksum = tail_sum + sum(name) + sum(size_field)
    return b"".join(
        (
            name,
            bytes(100 - len(name)),
            _MODE_UID_GID,
            size_field,
            _MTIME,
            b"%06o\x00 " % checksum,
            tail,
        )
    )


def tar_header(name: bytes, size: int) -> bytes:
    """The header record(s) of one regular-file member ``name`` of ``size`` bytes.

    Returns 512 bytes, or more when the name needs a GNU long-name record
    (512 for that record's header plus the name padded to 512-byte blocks).
    """
    if len(name) <= 100:
        return _one_header(name, size, _TAIL_REGULAR, _SUM_REGULAR)
    longname = name + b"\x00"
    return (
        _one_header(_LONGLINK, len(longname), _TAIL_LONGNAME, _SUM_LONGNAME)
        + longname
        + padding(len(longname))
        + _one_header(name[:100], size, _TAIL_REGULAR, _SUM_REGULAR)
    )


def padding(size: int) -> bytes:
    """Zero bytes that round a member of ``size`` bytes up to a 512-byte block."""
    return bytes(-size % BLOCK)


# --- sidecar index ---------------------------------------------------------------

_ARRAY_DTYPES: dict[str, str] = {
    "sample_offset": "<u8",  # n+1: tar offset of each sample's first header; [n] = end of data
    "member_start": "<u8",  # n+1: index of each sample's first member in the member_* arrays
    "member_ext": "<u2",  # m: position of the member's extension in ``exts``
    "member_offset": "<u8",  # m: tar offset of the member's data
    "member_size": "<u8",  # m: data size in bytes
    "member_hash": "<u8",  # m: payload_checksum of the member's data
    "sample_hash": "<u8",  # n (version 3; absent in 2): [sample_offset, sample_ends) ^ layout
    "label": "<i4",  # n: class index, -1 when unlabelled
    "copy": "<u4",  # n: 0 for an original sample, k for its k-th resampled copy
    "multiplicity": "<u4",  # n: copies of this sample's source in the whole output (0 never)
    "key_end": "<u8",  # n: end of each key in key_blob (utf-8)
    "source_end": "<u8",  # n: end of each source path in source_blob (utf-8)
    "frame_sample": "<u8",  # F+1: first sample of each zstd frame; [F] = n (empty for .tar)
    "frame_offset": "<u8",  # F+1: file offset of each zstd frame; [F] = file size
    "key_blob": "u1",
    "source_blob": "u1",
}


@dataclass(frozen=True, slots=True)
class ShardIndex:
    """Per-sample metadata of one shard, as numpy arrays (see ``_ARRAY_DTYPES``)."""

    exts: tuple[str, ...]
    sample_offset: npt.NDArray[np.uint64]
    member_start: npt.NDArray[np.uint64]
    member_ext: npt.NDArray[np.uint16]
    member_offset: npt.NDArray[np.uint64]
    member_size: npt.NDArray[np.uint64]
    member_hash: npt.NDArray[np.uint64]
    sample_hash: npt.NDArray[np.uint64]  # empty for a version 2 index
    label: npt.NDArray[np.int32]
    copy: npt.NDArray[np.uint32]
    multiplicity: npt.NDArray[np.uint32]
    key_end: npt.NDArray[np.uint64]
    source_end: npt.NDArray[np.uint64]
    frame_sample: npt.NDArray[np.uint64]
    frame_offset: npt.NDArray[np.uint64]
    key_blob: npt.NDArray[np.uint8]
    source_blob: npt.NDArray[np.uint8]
    version: int = INDEX_VERSION  # 3: sample_hash covers headers and padding; 2: no sample_hash

    @property
    def num_samples(self) -> int:
        """Number of samples in the shard."""
        return len(self.label)

    def key(self, i: int) -> str:
        """The key of sample ``i``."""
        start = int(self.key_end[i - 1]) if i else 0
        return bytes(self.key_blob[start : int(self.key_end[i])]).decode("utf-8")

    def source(self, i: int) -> str:
        """The source path (relative to the build input) of sample ``i``."""
        start = int(self.source_end[i - 1]) if i else 0
        return bytes(self.source_blob[start : int(self.source_end[i])]).decode(
            "utf-8", "surrogateescape"
        )


def sample_ends(index: ShardIndex, a: int, b: int) -> npt.NDArray[np.int64]:
    """Where the bytes that ``sample_hash`` covers end, for each of samples ``a:b``: the end
    of the sample's last member's data (its trailing padding is not covered); the sample's
    start for a sample without members. Sample ``i`` hashes ``[sample_offset[i], end)``."""
    starts = index.member_start[a : b + 1].astype(np.int64)
    end = index.sample_offset[a:b].astype(np.int64)
    full = np.flatnonzero(starts[1:] > starts[:-1])
    last = starts[1:][full] - 1
    end[full] = index.member_offset[last].astype(np.int64) + index.member_size[last].astype(
        np.int64
    )
    return end


_MIX = (
    np.uint64(0x9E3779B97F4A7C15),
    np.uint64(0xC2B2AE3D27D4EB4F),
    np.uint64(0x165667B19E3779F9),
)


def sample_layout(
    sample_offset: npt.NDArray[np.uint64],
    member_start: npt.NDArray[np.uint64],
    member_offset: npt.NDArray[np.uint64],
    member_size: npt.NDArray[np.uint64],
) -> npt.NDArray[np.uint64]:
    """A 64-bit digest of each sample's member layout (``len(sample_offset)`` samples whose
    members are ``member_*[member_start[i] - member_start[0]:...]``): the XOR over its
    members of a mix of (data offset from the sample's start, data size); 0 for a sample
    without members. Vectorised, once per chunk or shard."""
    first = member_start[0] if len(member_start) else np.uint64(0)
    starts = (member_start - first).astype(np.int64)
    owner = np.repeat(np.arange(len(sample_offset)), starts[1:] - starts[:-1])
    # (arrays of unsigned integers wrap around silently: no ``np.errstate``, which costs more
    # than the arithmetic on a chunk's few hundred members)
    relative = member_offset - sample_offset[owner]
    mixed = relative * _MIX[0] ^ member_size * _MIX[1]
    mixed ^= mixed >> np.uint64(31)
    mixed *= _MIX[2]
    mixed ^= mixed >> np.uint64(29)
    running = np.zeros(len(mixed) + 1, dtype=np.uint64)
    np.bitwise_xor.accumulate(mixed, out=running[1:])
    layout: npt.NDArray[np.uint64] = running[starts[1:]] ^ running[starts[:-1]]
    return layout


def sample_checksums(index: ShardIndex, a: int, b: int) -> npt.NDArray[np.uint64]:
    """The checksums (:func:`payload_checksum`) that samples ``a:b``'s tar bytes
    ``[sample_offset[i], sample_ends[i])`` must have, given the layout the index records for
    them: ``sample_hash ^ sample_layout`` (version 3 only)."""
    m0, m1 = int(index.member_start[a]), int(index.member_start[b])
    layout = sample_layout(
        index.sample_offset[a:b],
        index.member_start[a : b + 1],
        index.member_offset[m0:m1],
        index.member_size[m0:m1],
    )
    return index.sample_hash[a:b] ^ layout


def mismatched(
    data: bytes | memoryview,
    starts: npt.NDArray[np.int64],
    ends: npt.NDArray[np.int64],
    expected: npt.NDArray[np.uint64],
) -> npt.NDArray[np.bool_]:
    """Whether each span ``data[starts[i]:ends[i]]`` does not hash to ``expected[i]``
    (:func:`payload_checksum`). One pass in C (no Python frame per span): the slices, views
    and checksums are made by chained ``map`` calls and each view is dropped once hashed."""
    view = memoryview(data)
    spans = map(view.__getitem__, map(slice, starts.tolist(), ends.tolist()))
    got = np.fromiter(map(payload_checksum, spans), np.uint64, len(expected))
    failing: npt.NDArray[np.bool_] = got != expected
    return failing


V3_ONLY = ("sample_hash",)
"""Arrays a version 2 index does not have (empty when decoded)."""


def encode_index(exts: list[str], arrays: dict[str, Any], version: int = INDEX_VERSION) -> bytes:
    """Serialize an index: magic, u64 header length, JSON header, 8-aligned arrays.

    ``version`` other than :data:`INDEX_VERSION` is for tests that make older outputs (a
    version 2 index has no ``sample_hash``: ``arrays`` may leave it out).
    """
    header: dict[str, Any] = {
        "format": "shardprep-index",
        "version": version,
        "exts": exts,
        "arrays": {},
    }
    blobs: list[bytes] = []
    offset = 0
    for name, dtype in _ARRAY_DTYPES.items():
        if version == 2 and name in V3_ONLY:
            continue
        data = np.asarray(arrays[name], dtype=dtype).tobytes()
        header["arrays"][name] = [dtype, offset, len(data)]
        blobs.append(data + bytes(-len(data) % 8))
        offset += len(data) + (-len(data) % 8)
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return INDEX_MAGIC + struct.pack("<Q", len(head)) + head + b"".join(blobs)


def decode_index(data: bytes, path: str = "<index>") -> ShardIndex:
    """Parse bytes written by :func:`encode_index`.

    Raises:
        ManifestError: the bytes are not a shardprep index of a known version.
    """
    from shardprep.format.errors import ManifestError

    if data[:8] != INDEX_MAGIC or len(data) < 16:
        raise ManifestError(f"{path}: not a shardprep index (bad magic); rebuild the shards", path)
    (head_len,) = struct.unpack_from("<Q", data, 8)
    try:
        header = json.loads(data[16 : 16 + head_len])
        if not isinstance(header, dict) or header.get("format") != "shardprep-index":
            raise ValueError("not a shardprep-index header")
        version = header.get("version")
        if type(version) is not int or version not in READ_VERSIONS:
            raise ManifestError(
                f"{path}: index format version {version!r} is not one of the versions "
                f"{', '.join(map(str, READ_VERSIONS))} this shardprep reads (version 1 indexes "
                "have no per-sample checksums); rebuild the output with this shardprep "
                "(shardprep build ... --overwrite)",
                path,
            )
        base = 16 + head_len
        exts = header["exts"]
        if not isinstance(exts, list) or not all(isinstance(e, str) and e for e in exts):
            raise ValueError("exts is not a list of extensions")
        fields: dict[str, Any] = {"exts": tuple(exts), "version": version}
        for name, dtype in _ARRAY_DTYPES.items():
            if version == 2 and name in V3_ONLY:
                fields[name] = np.zeros(0, dtype=dtype)
                continue
            stored_dtype, offset, length = header["arrays"][name]
            itemsize = np.dtype(dtype).itemsize
            if stored_dtype != dtype or not all(type(v) is int for v in (offset, length)):
                raise ValueError(f"array {name} is of type {stored_dtype}")
            if offset < 0 or length < 0 or length % itemsize or base + offset + length > len(data):
                raise ValueError(f"array {name} is truncated or misplaced")
            fields[name] = np.frombuffer(
                data, dtype=dtype, count=length // itemsize, offset=base + offset
            )
    except (ValueError, KeyError, TypeError) as err:
        raise ManifestError(
            f"{path}: corrupt shard index ({err}); rebuild the shards", path
        ) from err
    return ShardIndex(**fields)
