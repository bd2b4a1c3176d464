"""What an image or audio payload is, from its first bytes: the member extension it gets.

A Parquet export holds pictures and sounds as bytes without a name (a Hugging Face
``Image()``/``Audio()`` struct whose ``path`` is null, a binary column named ``image``), so
the member's extension (which the loader's decoders go by) comes from the bytes' own
signature. Pure functions; no I/O.
"""

from __future__ import annotations

__all__ = ["MEDIA_COLUMNS", "SNIFF_BYTES", "describe_head", "sniff"]

MEDIA_COLUMNS = ("image", "audio")  # binary columns whose members are named by their bytes
SNIFF_BYTES = 16  # the head of a payload that :func:`sniff` looks at

_PREFIXES = (  # (signature at offset 0, extension), longest first where one prefixes another
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"\xff\xd8\xff", "jpg"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
    (b"fLaC", "flac"),
    (b"OggS", "ogg"),
    (b"ID3", "mp3"),
    (b"\x93NUMPY", "npy"),
)
_RIFF = {b"WEBP": "webp", b"WAVE": "wav"}  # RIFF....<form>
_BMP_HEADERS = (12, 40, 52, 56, 64, 108, 124)  # the DIB header sizes BMP files use
_MP3_LAYERS = (1, 2, 3)  # the layer bits of an MPEG audio frame header (0 is reserved)


def sniff(head: bytes) -> str | None:
    """The extension of the format ``head`` (a payload's first :data:`SNIFF_BYTES` bytes, or
    all of a shorter one) begins with, or None if it is none of: PNG, JPEG (``jpg``), GIF,
    WebP, BMP, TIFF, portable pixmaps (``ppm``/``pgm``), FLAC, WAV, MP3, Ogg, NumPy ``.npy``.

    Only whole signatures count: a BMP needs its DIB header size, an MP3 without an ID3 tag
    a valid frame header (sync, version, layer, bit rate and sample rate fields)."""
    for signature, ext in _PREFIXES:
        if head.startswith(signature):
            return ext
    if len(head) >= 12 and head[:4] == b"RIFF" and head[8:12] in _RIFF:
        return _RIFF[head[8:12]]
    if _bmp(head):
        return "bmp"
    if len(head) >= 3 and head[:1] == b"P" and head[1:2] in b"56" and head[2:3] in b" \t\n\r":
        return "pgm" if head[1:2] == b"5" else "ppm"
    if len(head) >= 4 and _mp3_frame(head):
        return "mp3"
    return None


def _bmp(head: bytes) -> bool:
    """True if ``head`` starts with a BMP file header (``BM``, reserved zeros, a DIB size)."""
    return (
        len(head) >= 16
        and head[:2] == b"BM"
        and head[6:10] == bytes(4)
        and int.from_bytes(head[14:16], "little") in _BMP_HEADERS
    )


def _mp3_frame(head: bytes) -> bool:
    """True if ``head`` starts with an MPEG-1/2/2.5 audio frame header (no ID3 tag)."""
    if head[0] != 0xFF or head[1] & 0xE0 != 0xE0:
        return False
    version, layer = (head[1] >> 3) & 3, (head[1] >> 1) & 3
    bitrate, rate = head[2] >> 4, (head[2] >> 2) & 3
    return version != 1 and layer in _MP3_LAYERS and bitrate not in (0, 15) and rate != 3


def describe_head(head: bytes) -> str:
    """A payload's first bytes for a message: ``89 50 4e 47 ...`` (empty: ``no bytes``)."""
    if not head:
        return "no bytes (an empty payload)"
    return " ".join(f"{b:02x}" for b in head[:8]) + (" ..." if len(head) > 8 else "")
