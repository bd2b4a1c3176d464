"""Integrity: what must hold between a manifest entry, its shard index and its shard file.

Pure checks, shared by the loader (``loader.read.reader``) and ``shardprep verify``,
so that nothing read from an index is trusted before it is checked:

- :func:`check_index`: the index agrees with its manifest entry (sample count,
  class histogram, sizes) and describes exactly the tar layout the writer
  produces (every member's header, offset and size, from offset 0 to the end
  marker), so every slice a reader takes lies inside its sample and inside
  the file; for ``.tar.zst`` the frame table covers every sample, within the
  file, and no frame declares more output than zstd can produce from its bytes.
- :func:`decompress_frame`: one zstd frame, decompressed only if its header
  declares exactly the span the index gives it, with that span as a hard
  output bound (a decompression bomb is an error, never an allocation).
- :func:`salvage_frame`: the part of a damaged frame that still decodes, to
  name the first damaged sample.
- :func:`damaged_headers`: the members of a range whose tar header records are
  not the bytes the writer makes from the index. A version 3 index's per-sample
  checksums (``sample_hash``) cover the headers (and the padding between members)
  already: this is needed on the hot path only for version 2 indexes, whose
  checksums cover only the data (``tar``, ``tarfile`` and WebDataset read the
  headers); for version 3, :func:`damage_of` uses it to say what of a sample
  failing its checksum is damaged.

``docs/format.md`` ("Validation") lists the same rules.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from shardprep.format.errors import ManifestError
from shardprep.format.manifest import ShardEntry
from shardprep.format.shardformat import (
    BLOCK,
    EOF_MARKER,
    FRAME_BYTES,
    ShardIndex,
    payload_checksum,
    reserved_member,
    sample_checksums,
    sample_ends,
    tar_header,
)

__all__ = [
    "MAX_ZSTD_RATIO",
    "FrameError",
    "check_index",
    "damaged_headers",
    "damage_of",
    "damaged_samples",
    "decompress_frame",
    "first_damaged_sample",
    "salvage_frame",
]

MAX_ZSTD_RATIO = 32768
"""No zstd frame decompresses to more than this many times its size: a block holds at most
128 KiB of output and takes at least 4 bytes (3-byte header + 1, an RLE block)."""


class FrameError(ValueError):
    """A zstd frame does not decompress to the span the index gives it (``str`` says why)."""


def _key(index: ShardIndex, i: int) -> str:
    start = int(index.key_end[i - 1]) if i else 0
    return bytes(index.key_blob[start : int(index.key_end[i])]).decode("utf-8", "replace")


def check_index(
    index: ShardIndex, entry: ShardEntry, compressed: bool, num_classes: int, where: str
) -> None:
    """Refuse an index that disagrees with ``entry`` or with the layout the writer produces.

    ``num_classes`` is 0 for unlabelled data; ``where`` names the index in errors.

    Raises:
        ManifestError: naming the index, the sample key where one is involved,
            and the field that is wrong.
    """
    problem = _index_problem(index, entry, compressed, num_classes)
    if problem:
        raise ManifestError(
            f"{where}: {problem}; the index does not describe its shard (corrupt or edited): "
            "rebuild the output",
            where,
        )


def _index_problem(index: ShardIndex, entry: ShardEntry, compressed: bool, num_classes: int) -> str:
    n, m = index.num_samples, len(index.member_size)
    if n != entry.num_samples:
        return f"the index has {n} samples, the manifest says {entry.num_samples}"
    lengths = {
        "sample_offset": n + 1,
        "member_start": n + 1,
        "member_ext": m,
        "member_offset": m,
        "member_hash": m,
        "sample_hash": n if index.version != 2 else 0,
        "copy": n,
        "multiplicity": n,
        "key_end": n,
        "source_end": n,
    }
    for name, length in lengths.items():
        if len(getattr(index, name)) != length:
            return f"array {name} has {len(getattr(index, name))} entries, not {length}"
    # keys and sources: increasing ends within their blobs, no empty key
    for ends, blob, what in (
        (index.key_end, index.key_blob, "key"),
        (index.source_end, index.source_blob, "source path"),
    ):
        steps = np.diff(ends, prepend=np.uint64(0)).astype(np.int64) if n else ends
        bad = np.flatnonzero((steps < 1) if what == "key" else (steps < 0))
        if len(bad) or (n and int(ends[-1]) != len(blob)) or (not n and len(blob)):
            return f"{what} table is inconsistent" + (
                f" at sample {int(bad[0])}" if len(bad) else ""
            )
    problem = _key_text_problem(index)
    if problem:
        return problem
    # labels and the class histogram
    label = index.label
    if num_classes:
        bad = np.flatnonzero((label < 0) | (label >= num_classes))
        if len(bad):
            i = int(bad[0])
            return f"sample {_key(index, i)!r}: label {int(label[i])} is not a class index"
        counts = np.bincount(label, minlength=num_classes).tolist()
        if counts != list(entry.class_counts):
            return (
                f"class histogram {counts} differs from the manifest's {list(entry.class_counts)}"
            )
    elif np.any(label != -1):
        return "labels in an unlabelled output"
    # members: at least one per sample, known extensions
    starts = index.member_start.astype(np.int64)
    if int(starts[0]) != 0 or int(starts[-1]) != m or np.any(np.diff(starts) < 1):
        bad = np.flatnonzero(np.diff(starts) < 1)
        at = f" (sample {_key(index, int(bad[0]))!r})" if len(bad) else ""
        return f"member table is inconsistent{at}"
    if m and int(index.member_ext.max()) >= len(index.exts):
        k = int(np.argmax(index.member_ext >= len(index.exts)))
        return f"sample {_key(index, _owner(starts, k))!r}: unknown member extension"
    problem = _reserved_problem(index, starts)
    if problem:
        return problem
    return _layout_problem(index, entry, starts) or (
        _frames_problem(index, entry) if compressed else _no_frames_problem(index)
    )


def _key_text_problem(index: ShardIndex) -> str:
    """Why a key is not text as the builder writes it (UTF-8, no NUL byte), or ``""``.

    A key of the per-sample path is ``bytes.decode()``d and the batch path's is one NumPy
    string array, which drops a NUL at a key's end: both would differ, or fail, on such a key.
    The blob is UTF-8 and every key starts on a character (not on a continuation byte)
    exactly when every key is UTF-8 on its own.
    """
    blob = index.key_blob
    if not len(blob):
        return ""
    ends = index.key_end.astype(np.int64)

    def owner(position: int) -> str:
        return repr(_key(index, int(np.searchsorted(ends, position, side="right"))))

    nul = np.flatnonzero(blob == 0)
    if len(nul):
        return f"sample {owner(int(nul[0]))}: its key holds a NUL byte"
    try:
        blob.tobytes().decode("utf-8")
    except UnicodeDecodeError as err:
        return f"sample {owner(err.start)}: its key is not UTF-8"
    inside = np.flatnonzero((blob[ends[:-1]] & 0xC0) == 0x80)  # a key starting mid-character
    if len(inside):
        return f"sample {owner(int(ends[int(inside[0])]))}: its key is not UTF-8"
    return ""


def _reserved_problem(index: ShardIndex, starts: npt.NDArray[np.int64]) -> str:
    """Why a member would stand in for a field the loader sets itself (``__key__``,
    ``__padded__``...: ``reserved_member``), naming the first sample that holds one; or ``""``.
    Shards of other tools (or older builders) reach the reader too."""
    for number, ext in enumerate(index.exts):
        if reserved_member(ext):
            members = np.flatnonzero(index.member_ext == number)
            if len(members):
                return (
                    f"sample {_key(index, _owner(starts, int(members[0])))!r}: its member "
                    f".{ext} is named as a field the loader sets itself (every __name__ is "
                    "reserved) and would be handed out in place of it"
                )
    return ""


def _owner(starts: npt.NDArray[np.int64], member: int) -> int:
    return int(np.searchsorted(starts, member, side="right")) - 1


def _layout_problem(index: ShardIndex, entry: ShardEntry, starts: npt.NDArray[np.int64]) -> str:
    """Offsets and sizes are exactly the writer's tar layout, inside the file."""
    n, m = index.num_samples, len(index.member_size)
    end = entry.tar_bytes - len(EOF_MARKER)
    # bound every value first: no arithmetic below can overflow
    for name in ("sample_offset", "member_offset", "member_size"):
        values = getattr(index, name)
        if len(values) and int(values.max()) > end:
            i = int(np.argmax(values > end))
            sample = i if name == "sample_offset" else _owner(starts, i)
            key = _key(index, min(sample, n - 1)) if n else "-"
            return (
                f"sample {key!r}: {name} {int(values[i])} lies past the end of the tar data ({end})"
            )
    sample_offset = index.sample_offset.astype(np.int64)
    if int(sample_offset[0]) != 0 or int(sample_offset[-1]) != end:
        return f"samples span [{int(sample_offset[0])}, {int(sample_offset[-1])}), not [0, {end})"
    if not m:
        return ""
    offset = index.member_offset.astype(np.int64)
    size = index.member_size.astype(np.int64)
    owner = np.repeat(np.arange(n), np.diff(starts))
    key_len = np.diff(index.key_end.astype(np.int64), prepend=0)
    ext_len = np.array([len(e.encode("utf-8", "surrogateescape")) for e in index.exts])
    name_len = key_len[owner] + 1 + ext_len[index.member_ext]
    header = np.where(
        name_len <= 100, BLOCK, 2 * BLOCK + (name_len + 1 + BLOCK - 1) // BLOCK * BLOCK
    )
    data_end = offset + (size + BLOCK - 1) // BLOCK * BLOCK
    previous = np.empty(m, dtype=np.int64)
    previous[1:] = data_end[:-1]
    previous[starts[:-1]] = sample_offset[:-1]
    bad = np.flatnonzero(offset != previous + header)
    if len(bad):
        k = int(bad[0])
        return (
            f"sample {_key(index, int(owner[k]))!r}: member {k} at offset {int(offset[k])} "
            f"({int(size[k])} bytes) is not where the tar layout puts it ({int(previous[k] + header[k])})"
        )
    bad = np.flatnonzero(data_end[starts[1:] - 1] != sample_offset[1:])
    if len(bad):
        i = int(bad[0])
        return (
            f"sample {_key(index, i)!r}: its members end at {int(data_end[starts[i + 1] - 1])}, "
            f"the next sample starts at {int(sample_offset[i + 1])}"
        )
    return ""


def _no_frames_problem(index: ShardIndex) -> str:
    if len(index.frame_sample) or len(index.frame_offset):
        return "a zstd frame table in the index of a plain .tar shard"
    return ""


def _frames_problem(index: ShardIndex, entry: ShardEntry) -> str:
    """The frame table covers every sample, inside the file, within zstd's possible expansion."""
    n = index.num_samples
    frames = index.frame_sample.astype(np.int64)
    offsets = index.frame_offset.astype(np.int64)
    if (
        len(frames) != len(offsets)
        or len(frames) < 1
        or int(frames[0]) != 0
        or int(frames[-1]) != n
        or int(offsets[0]) != 0
        or np.any(np.diff(frames) < 1)
        or np.any(np.diff(offsets) < 1)
        or int(index.frame_offset.max()) >= entry.num_bytes
    ):
        return (
            f"the zstd frame table does not cover samples 0..{n} in order inside the "
            f"{entry.num_bytes}-byte file"
        )
    sample_offset = index.sample_offset.astype(np.int64)
    span = np.diff(sample_offset[frames])
    stored = np.diff(offsets)
    last = sample_offset[frames[1:]] - sample_offset[frames[1:] - 1]
    bad = np.flatnonzero((span > stored * MAX_ZSTD_RATIO) | (span - last >= FRAME_BYTES))
    if len(bad):
        f = int(bad[0])
        return (
            f"zstd frame {f} (from sample {_key(index, int(frames[f]))!r}) spans {int(span[f])} "
            f"tar bytes in {int(stored[f])} compressed bytes, which no frame of this format holds"
        )
    return ""


def decompress_frame(decompressor: Any, frame: bytes, span: int) -> bytes:
    """The ``span`` bytes that zstd ``frame`` holds; never more output than ``span``.

    Raises:
        FrameError: the frame's header declares another size (or none), or the
            frame does not decompress to exactly ``span`` bytes.
    """
    import zstandard

    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as err:
        raise FrameError(f"unreadable frame header ({err})") from err
    if declared != span:
        shown = "no size" if declared < 0 else f"{declared} bytes"
        raise FrameError(f"its header declares {shown}, the index {span} bytes")
    try:
        data: bytes = decompressor.decompress(frame, allow_extra_data=False)
    except zstandard.ZstdError as err:
        raise FrameError(str(err)) from err
    if len(data) != span:  # pragma: no cover - zstd checks the declared size itself
        raise FrameError(f"decompresses to {len(data)} bytes, the index says {span}")
    return data


def salvage_frame(frame: bytes, span: int) -> bytes:
    """What still decodes of a damaged frame, at most ``span`` bytes, without its checksum.

    Used only after :func:`decompress_frame` failed, to find the first damaged
    sample: the frame's content checksum is dropped (so damage inside a
    sample's bytes decodes, and the per-sample checksums point at it), and
    output stops at the first undecodable block or at ``span``.
    """
    import zstandard

    stripped = frame
    if len(frame) >= 9 and frame[4] & 0x04:  # Content_Checksum_flag (RFC 8878, 3.1.1.1.1)
        stripped = frame[:4] + bytes([frame[4] & ~0x04]) + frame[5:-4]
    out = bytearray()
    reader = zstandard.ZstdDecompressor().stream_reader(stripped, read_across_frames=False)
    while len(out) < span:
        try:
            piece = reader.read(min(BLOCK, span - len(out)))
        except zstandard.ZstdError:
            break  # the damage: everything before it is in ``out``
        if not piece:
            break
        out += piece
    return bytes(out)


def damaged_samples(
    index: ShardIndex,
    data: bytes | memoryview,
    base: int,
    start: int,
    stop: int,
    first_only: bool = False,
) -> list[int]:
    """Samples of ``start..stop-1`` with a member missing from ``data`` or failing a checksum.

    ``data`` holds the tar bytes from offset ``base``; ``first_only`` stops at the first one.
    Every member's data is checked against ``member_hash`` and, for a version 3 index, every
    sample's bytes (headers and padding between members too) against ``sample_hash``; a
    version 2 index's samples are checked for damaged headers (:func:`damaged_headers`).
    """
    view = memoryview(data)
    starts, offsets, sizes, hashes = (
        index.member_start,
        index.member_offset,
        index.member_size,
        index.member_hash,
    )
    v3 = index.version != 2
    if v3 and stop > start:
        spans = zip(
            (index.sample_offset[start:stop].astype(np.int64) - base).tolist(),
            (sample_ends(index, start, stop) - base).tolist(),
            sample_checksums(index, start, stop).tolist(),
            strict=True,
        )
    found = []
    for i in range(start, stop):
        if v3:
            a, b, recorded = next(spans)
            if b > len(view) or payload_checksum(view[a:b]) != recorded:
                found.append(i)
                if first_only:
                    return found
                continue
        for m in range(int(starts[i]), int(starts[i + 1])):
            a = int(offsets[m]) - base
            b = a + int(sizes[m])
            if b > len(view) or payload_checksum(view[a:b]) != int(hashes[m]):
                found.append(i)
                if first_only:
                    return found
                break
    if not v3:
        found = _with_damaged_headers(index, view, base, start, stop, found, first_only)
    return found


def _with_damaged_headers(
    index: ShardIndex,
    view: memoryview,
    base: int,
    start: int,
    stop: int,
    found: list[int],
    first_only: bool,
) -> list[int]:
    """``found`` and the samples of ``start..stop-1`` that ``view`` holds whole with a
    damaged header (version 2 checksums do not cover headers)."""
    whole = stop
    while whole > start and int(index.sample_offset[whole]) - base > len(view):
        whole -= 1  # samples cut off by the end of ``view`` are in ``found`` already
    members = damaged_headers(index, view, base, start, whole)
    owners = np.searchsorted(index.member_start, members, side="right") - 1
    merged = sorted(set(found) | set(owners.tolist()))
    return merged[:1] if first_only else merged


def damage_of(
    index: ShardIndex, data: bytes | memoryview, base: int, sample: int
) -> tuple[str, int]:
    """What of ``sample`` is damaged, for an error message once its ``sample_hash`` (version
    3) failed: ``(what, member)`` for its first member with damaged tar header records
    (``"header"``), non-zero padding before them (``"padding"``) or data failing its
    ``member_hash`` (``"data"``); ``("sample", -1)`` if none is (then the recorded
    ``sample_hash`` is what is wrong). ``data`` holds the tar bytes from ``base`` to at
    least the end of the sample."""
    view = memoryview(data)
    first, last = int(index.member_start[sample]), int(index.member_start[sample + 1])
    headers = set(damaged_headers(index, data, base, sample, sample + 1).tolist())
    for member in range(first, last):
        if member in headers:
            return "header", member
        if member > first:
            end = int(index.member_offset[member - 1]) + int(index.member_size[member - 1]) - base
            pad = -int(index.member_size[member - 1]) % BLOCK
            if bytes(view[end : end + pad]) != bytes(pad):
                return "padding", member
        a = int(index.member_offset[member]) - base
        if payload_checksum(view[a : a + int(index.member_size[member])]) != int(
            index.member_hash[member]
        ):
            return "data", member
    return "sample", -1


def first_damaged_sample(
    index: ShardIndex, data: bytes | memoryview, base: int, start: int, stop: int
) -> int:
    """The first of :func:`damaged_samples`, or ``stop`` if every sample is complete and intact."""
    found = damaged_samples(index, data, base, start, stop, first_only=True)
    return found[0] if found else stop


# --- tar headers -------------------------------------------------------------------
# Every header the writer makes is ``shardformat.tar_header(key + "." + ext, size)``: fixed
# bytes but for the name (bytes 0-99), the size (124-135, 11 octal digits and a NUL) and the
# ustar checksum (148-153, 6 octal digits). Headers are compared as 64 words of 8 bytes (in
# the machine's byte order, the same for both sides): words 0-12 hold the name (and the
# mode's first 4 bytes), 15-16 the size, 18-19 the checksum, each among fixed bytes.
_WORDS = BLOCK // 8
_NAME_BYTES = 100
_NAME_WORDS = 13
_EMPTY = np.frombuffer(tar_header(b"", 0), dtype=np.uint8)
_EMPTY_WORDS = _EMPTY.view(np.uint64)
# the checksum of a header with an empty name and size 0, less the size's 11 "0" digits
_BASE_SUM = int(_EMPTY.sum()) - int(_EMPTY[148:156].sum()) + 8 * ord(" ") - 11 * ord("0")
_NE = sys.byteorder == "little"


def _packed_octal() -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]]:
    """For x < 4096: its 4 octal digits as ASCII bytes packed into a word (first digit in the
    word's first byte in memory), and the sum of those bytes."""
    text = np.frombuffer(b"".join(b"%04o" % x for x in range(4096)), np.uint8).reshape(-1, 4)
    words = np.zeros((4096, 8), dtype=np.uint8)
    words[:, :4] = text
    return words.view(np.uint64).ravel().copy(), text.sum(axis=1, dtype=np.int64)


_OCTAL, _OCTAL_SUM = _packed_octal()


def _shift(word: npt.NDArray[np.uint64], nbytes: int) -> npt.NDArray[np.uint64]:
    """``word``'s bytes moved ``nbytes`` later in memory (earlier if negative)."""
    bits = np.uint64(8 * abs(nbytes))
    shifted: npt.NDArray[np.uint64] = word << bits if (nbytes > 0) == _NE else word >> bits
    return shifted


def _word(header: npt.NDArray[np.uint8], first: int, keep: list[int]) -> np.uint64:
    """The word of ``header`` at byte ``first``, with only the bytes at offsets ``keep``."""
    chosen = np.zeros(8, dtype=np.uint8)
    chosen[keep] = header[first : first + 8][keep]
    word: np.uint64 = chosen.view(np.uint64)[0]
    return word


_FIXED_15 = _word(_EMPTY, 120, [0, 1, 2, 3])  # gid's last bytes; 124-127: size digits 0-3
_FIXED_18 = _word(_EMPTY, 144, [0, 1, 2, 3])  # mtime's last bytes; 148-151: checksum digits
_FIXED_19 = _word(_EMPTY, 152, [3, 4, 5, 6, 7])  # "\0", " " (after the digits), typeflag...


_HEADERS_AT_ONCE = 1024  # headers compared per step: 512 KiB each side


class _Scratch(threading.local):
    """One thread's arrays for :func:`damaged_headers`, made once: fresh arrays of this size,
    freed at each return, cost a page fault per 4 KiB on the next call (glibc gives such
    sizes back to the system). ``expected`` holds the template's fixed words for good; only
    the name, size and checksum words are written per step."""

    def __init__(self) -> None:
        self.found = np.empty((_HEADERS_AT_ONCE, _WORDS), dtype=np.uint64)
        self.expected = np.empty((_HEADERS_AT_ONCE, _WORDS), dtype=np.uint64)
        self.expected[:] = _EMPTY_WORDS
        self.names = np.empty((_HEADERS_AT_ONCE, _NAME_WORDS), dtype=np.uint64)


_SCRATCH: _Scratch | None = None


def _scratch() -> _Scratch:
    global _SCRATCH
    if _SCRATCH is None:
        _SCRATCH = _Scratch()
    return _SCRATCH


Words = npt.NDArray[np.uint64]
Ints = npt.NDArray[np.int64]


@functools.lru_cache(maxsize=64)
def _ext_words(exts: tuple[str, ...]) -> tuple[Words, Ints, Ints]:
    """Row ``e * 101 + at``: the name words holding ``"." + exts[e]`` at byte ``at`` (and the
    mode's first bytes, 100-103), zero elsewhere; each ``"." + ext``'s byte sum and length."""
    rows = np.zeros((len(exts), _NAME_BYTES + 1, _NAME_WORDS * 8), dtype=np.uint8)
    rows[:, :, _NAME_BYTES:] = _EMPTY[_NAME_BYTES : _NAME_WORDS * 8]
    sums = []
    for e, ext in enumerate(exts):
        dotted = np.frombuffer(b"." + ext.encode("utf-8", "surrogateescape"), np.uint8)
        sums.append(int(dotted.sum()))
        for at in range(_NAME_BYTES + 1 - len(dotted)):
            rows[e, at, at : at + len(dotted)] = dotted
    words = rows.reshape(-1, _NAME_WORDS * 8).view(np.uint64)
    lengths = [len(e.encode("utf-8", "surrogateescape")) + 1 for e in exts]
    return words, np.array(sums, dtype=np.int64), np.array(lengths, dtype=np.int64)


def damaged_headers(
    index: ShardIndex, data: bytes | memoryview, base: int, start: int, stop: int
) -> npt.NDArray[np.int64]:
    """Members of samples ``start..stop-1`` whose tar header records differ from the writer's.

    ``data`` holds the tar bytes from offset ``base`` (a sample's start) to at least the end
    of sample ``stop - 1``. A member's header is ``tar_header(key + "." + ext, size)`` from the
    index (:func:`check_index` has checked that it fits before the member's data), so every
    byte of it is known: a damaged name, size, checksum or fixed field is found, not only
    what the ustar checksum would catch. Returns member numbers of the index, ascending.

    The usual header (a name of at most 100 bytes, a size under 8 GiB) is checked by a few
    NumPy operations over the whole range (each header copied once and compared once with
    the expected bytes, made from the index); long names and huge sizes one by one.
    """
    m0, m1 = int(index.member_start[start]), int(index.member_start[stop])
    if m1 == m0:
        return np.zeros(0, dtype=np.int64)
    starts = index.member_start[start : stop + 1].astype(np.int64)
    counts = starts[1:] - starts[:-1]
    owner = np.repeat(np.arange(stop - start), counts)  # sample of each member, from ``start``
    offset = index.member_offset[m0:m1].astype(np.int64) - base
    size = index.member_size[m0:m1].astype(np.int64)
    ext = index.member_ext[m0:m1].astype(np.int64)
    key_start = int(index.key_end[start - 1]) if start else 0
    key_end = index.key_end[start:stop].astype(np.int64) - key_start
    key_len = np.diff(key_end, prepend=0)
    blob = index.key_blob[key_start : key_start + int(key_end[-1])]
    ext_words = _ext_words(index.exts)
    at = key_len[owner]  # where each name's ".ext" starts
    odd = np.flatnonzero((at + ext_words[2][ext] > _NAME_BYTES) | (size >> 33 > 0))
    bad = [int(k) for k in odd if not _header_matches(index, data, m0 + int(k), int(offset[k]))]
    usual = np.arange(m1 - m0)
    if len(odd):  # rare: names over 100 bytes, members of 8 GiB or more
        usual = np.setdiff1d(usual, odd)
        owner, offset, size, ext, at = (a[usual] for a in (owner, offset, size, ext, at))
    words = np.frombuffer(data, np.uint64, len(data) // BLOCK * _WORDS).reshape(-1, _WORDS)
    rows = offset // BLOCK - 1  # the header block before each member's data (ascending)
    if len(rows) and not 0 <= int(rows[0]) <= int(rows[-1]) < len(words):
        raise ValueError(f"tar headers outside the {len(data)} bytes given")  # a caller's bug
    keys = (*_key_words(blob, key_len, key_end - key_len), *ext_words)
    scratch = _scratch()
    for i in range(0, len(usual), _HEADERS_AT_ONCE):
        part = slice(i, i + _HEADERS_AT_ONCE)
        count = len(rows[part])
        found = np.take(words, rows[part], axis=0, out=scratch.found[:count], mode="clip")
        expected = scratch.expected[:count]
        names = scratch.names[:count]
        _expected_headers(expected, names, keys, at[part], owner[part], ext[part], size[part])
        if payload_checksum(found.data) != payload_checksum(expected.data):  # no temporaries
            bad += usual[part][np.flatnonzero((found != expected).any(axis=1))].tolist()
    return m0 + np.array(sorted(bad), dtype=np.int64)


def _key_words(blob: npt.NDArray[np.uint8], key_len: Ints, key_start: Ints) -> tuple[Words, Ints]:
    """Each key of ``blob`` (of ``key_len`` bytes from ``key_start``) zero-padded to the name
    field's 13 words (keys too long for it: zeros), and each key's byte sum."""
    keys = np.zeros((len(key_len), _NAME_WORDS * 8), dtype=np.uint8)
    longest = int(key_len.max())
    if longest < _NAME_BYTES:  # as keys are (see key_array in loader.read.reader)
        keys[:, :longest][np.arange(longest) < key_len[:, None]] = blob
    else:
        fits = key_len < _NAME_BYTES
        lengths = key_len[fits]
        rows = np.repeat(np.flatnonzero(fits), lengths)
        firsts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        keys[rows, np.arange(len(rows)) - firsts] = blob[np.repeat(fits, key_len)]
    return keys.view(np.uint64), np.add.reduceat(blob, key_start, dtype=np.int64)


def _expected_headers(
    expected: Words,
    names: Words,
    keys: tuple[Words, Ints, Words, Ints, Ints],
    at: Ints,
    owner: Ints,
    ext: Ints,
    size: Ints,
) -> None:
    """Write into ``expected`` (rows of 64 words that hold the template's fixed words) the name,
    size and checksum words of ``tar_header(key + "." + ext, size)`` of each member (names of
    at most 100 bytes, sizes under 8 GiB); ``owner``: each member's key (a row of ``keys``,
    from :func:`_key_words` and :func:`_ext_words`), ``at``: its length; ``names``: scratch."""
    key_words, key_sum, ext_words, ext_sum, _ = keys
    name = expected[:, :_NAME_WORDS]
    np.take(key_words, owner, axis=0, out=name, mode="clip")
    np.take(ext_words, ext * 101 + at, axis=0, out=names, mode="clip")
    name |= names
    # size: 11 octal digits, as 3 + 4 + 4 from the table of 4-digit groups
    high, middle, low = _OCTAL[size >> 24], _OCTAL[(size >> 12) & 4095], _OCTAL[size & 4095]
    expected[:, 15] = _FIXED_15 | _shift(_shift(high, -1), 4) | _shift(middle, 7)
    expected[:, 16] = _shift(middle, -1) | _shift(low, 3)
    checksum = (
        _BASE_SUM
        + key_sum[owner]
        + ext_sum[ext]
        + _OCTAL_SUM[size >> 24]
        - ord("0")
        + _OCTAL_SUM[(size >> 12) & 4095]
        + _OCTAL_SUM[size & 4095]
    )
    # checksum: 6 octal digits (it is below 512 * 255 < 8 ** 6), then "\0 "
    high, low = _OCTAL[checksum >> 12], _OCTAL[checksum & 4095]
    expected[:, 18] = _FIXED_18 | _shift(_shift(high, -2), 4) | _shift(low, 6)
    expected[:, 19] = _FIXED_19 | _shift(low, -2)


def _header_matches(index: ShardIndex, data: bytes | memoryview, member: int, offset: int) -> bool:
    """Whether member ``member``'s header records (a GNU long name, a base-256 size), which end
    at ``offset`` of ``data``, are exactly the writer's."""
    sample = int(np.searchsorted(index.member_start, member, side="right")) - 1
    start = int(index.key_end[sample - 1]) if sample else 0
    key = bytes(index.key_blob[start : int(index.key_end[sample])])
    ext = index.exts[int(index.member_ext[member])].encode("utf-8", "surrogateescape")
    expected = tar_header(key + b"." + ext, int(index.member_size[member]))
    return offset >= len(expected) and bytes(data[offset - len(expected) : offset]) == expected
