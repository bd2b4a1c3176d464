"""Issue 37 item 1: image and audio columns of Parquet exports become members whose
extension the decoders know, taken from the payload's own bytes (else its path), one
extension per column; what cannot be named so is refused, never written undecodable.

The exports are written by ``datasets`` itself (``Image()`` columns of in-memory pictures:
``path`` null) and by pyarrow in the shapes Hugging Face and Spark use.
"""

from __future__ import annotations

import io
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardprep
from loader import ShardDataset
from shardprep.scan.media import sniff
from shardprep.scan.parquet import ParquetInputError
from tests.integration.test_parquet_input import shard_members

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
Image = pytest.importorskip("PIL.Image")

STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # HF Image()/Audio()


def picture(i: int, fmt: str, mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, (3 + i % 4, 2 + i % 3), (i * 40) % 256 if mode == "L" else (i, 9, 99)).save(
        out, fmt
    )
    return out.getvalue()


def wav(i: int) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as sound:
        sound.setnchannels(1)
        sound.setsampwidth(2)
        sound.setframerate(8000)
        sound.writeframes(np.arange(i + 4, dtype="<i2").tobytes())
    return out.getvalue()


def flac(i: int) -> bytes:
    """A FLAC stream's signature and STREAMINFO block header (enough to be told by its bytes)."""
    return b"fLaC\x80\x00\x00\x22" + bytes([i]) * 34


@pytest.mark.parametrize(
    ("data", "ext"),
    [
        *((picture(1, f), e) for f, e in (("PNG", "png"), ("JPEG", "jpg"), ("GIF", "gif"))),
        *((picture(1, f), e) for f, e in (("WEBP", "webp"), ("BMP", "bmp"), ("TIFF", "tiff"))),
        (picture(1, "PPM"), "ppm"),
        (picture(1, "PPM", "L"), "pgm"),
        (wav(3), "wav"),
        (flac(0), "flac"),
        (b"OggS\x00\x02" + bytes(10), "ogg"),
        (b"ID3\x04\x00\x00" + bytes(10), "mp3"),
        (b"\xff\xfb\x90\x64" + bytes(12), "mp3"),  # an MPEG-1 layer III frame, no ID3 tag
    ],
)
def test_a_payloads_own_bytes_name_its_format(data: bytes, ext: str) -> None:
    assert sniff(data[:16]) == ext


@pytest.mark.parametrize(
    "data",
    [b"", b"x", b"BM" + bytes(14), b"\xff\xfb\xf0\x00", b"RIFF\x00\x00\x00\x00AVI ", b"P7 3"],
)
def test_bytes_of_no_known_format_are_none(data: bytes) -> None:
    assert sniff(data[:16]) is None


def test_a_datasets_image_column_of_in_memory_pictures_decodes_as_images(tmp_path: Path) -> None:
    """``datasets`` writes in-memory PIL images as PNG bytes with a null path: was .image."""
    datasets = pytest.importorskip("datasets")
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=["a", "b"]),
            "key": datasets.Value("string"),
        }
    )
    pictures = [Image.open(io.BytesIO(picture(i, "PNG"))) for i in range(6)]
    rows = {
        "image": pictures,
        "label": [i % 2 for i in range(6)],
        "key": [f"k{i}" for i in range(6)],
    }
    data = datasets.Dataset.from_dict(rows, features=features)
    data.to_parquet(str(tmp_path / "train.parquet"))
    assert pq.read_table(tmp_path / "train.parquet").column("image")[0]["path"].as_py() is None
    shardprep.build(
        str(tmp_path / "train.parquet"), str(tmp_path / "out"), shards=2, progress=False
    )
    samples = {k: v for shard in shard_members(tmp_path / "out") for k, v in shard.items()}
    assert {k: sorted(v) for k, v in samples.items()} == {f"k{i}": ["cls", "png"] for i in range(6)}
    decoded = {s["__key__"]: s for s in ShardDataset(str(tmp_path / "out"), decode=True)}
    for i in range(6):
        expected = np.asarray(pictures[i].convert("RGB")).transpose(2, 0, 1)
        assert np.array_equal(np.asarray(decoded[f"k{i}"]["png"]), expected)
        assert int(decoded[f"k{i}"]["cls"]) == i % 2


def test_a_binary_column_named_image_or_audio_gets_its_payloads_format(tmp_path: Path) -> None:
    """Spark and Hugging Face name the bytes ``image``: was a member .image, never decoded."""
    raw = tmp_path / "part-00000.parquet"
    table = {
        "key": [f"r{i}" for i in range(4)],
        "image": [picture(i, "JPEG") for i in range(4)],
        "audio": [wav(i) for i in range(4)],
        "voice": pa.array([{"bytes": flac(i), "path": None} for i in range(4)], STRUCT),
    }
    pq.write_table(pa.table(table), raw, row_group_size=3)
    shardprep.build(str(raw), str(tmp_path / "out"), shards=1, progress=False)
    samples = shard_members(tmp_path / "out")[0]
    assert samples == {
        f"r{i}": {"jpg": picture(i, "JPEG"), "wav": wav(i), "flac": flac(i)} for i in range(4)
    }
    # (the .flac here is a signature and a header, no stream: kept as bytes)
    decode = {"flac": bytes}
    sample = next(iter(ShardDataset(str(tmp_path / "out"), decode=decode)))
    assert np.asarray(sample["jpg"]).shape[0] == 3  # an image: (channels, height, width)
    waveform, rate = sample["wav"]  # audio: (channels, frames), the sample rate
    assert rate == 8000 and tuple(waveform.shape) == (1, 4 + int(sample["__key__"][1:]))


def test_a_struct_payload_of_no_known_format_takes_its_paths_extension(tmp_path: Path) -> None:
    raw = tmp_path / "a.parquet"
    cells = [{"bytes": b"\x00\x00\x00\x1cftypavif-%d" % i, "path": f"d/{i}.AVIF"} for i in range(2)]
    pq.write_table(pa.table({"key": ["a", "b"], "image": pa.array(cells, STRUCT)}), raw)
    shardprep.build(str(raw), str(tmp_path / "out"), shards=1, progress=False)
    assert shard_members(tmp_path / "out")[0] == {
        k: {"avif": c["bytes"]} for k, c in zip("ab", cells, strict=True)
    }


def test_a_path_that_disagrees_with_the_bytes_gives_way_to_them(tmp_path: Path) -> None:
    raw = tmp_path / "a.parquet"
    cells = [
        {"bytes": picture(0, "PNG"), "path": "x.jpeg"},
        {"bytes": picture(1, "PNG"), "path": None},
    ]
    pq.write_table(pa.table({"key": ["a", "b"], "image": pa.array(cells, STRUCT)}), raw)
    shardprep.build(str(raw), str(tmp_path / "out"), shards=1, progress=False)
    assert {k: sorted(v) for k, v in shard_members(tmp_path / "out")[0].items()} == {
        "a": ["png"],
        "b": ["png"],
    }


def _refused(raw: Path, out: Path) -> str:
    with pytest.raises(ParquetInputError) as caught:
        shardprep.build(str(raw), str(out), shards=1, progress=False)
    assert not out.exists()
    return str(caught.value)


def test_an_image_column_of_unknown_bytes_is_refused_naming_file_column_row(
    tmp_path: Path,
) -> None:
    raw = tmp_path / "a.parquet"
    table = {"key": ["a", "b", "c"], "image": [picture(0, "PNG"), picture(1, "PNG"), b"\x01\x02"]}
    pq.write_table(pa.table(table), raw)
    message = _refused(raw, tmp_path / "out")
    assert message.startswith(
        f"{raw}: row 2: column 'image' holds bytes of no format shardprep recognises "
        "(PNG, JPEG, GIF, WebP, BMP, TIFF, PPM/PGM, FLAC, WAV, MP3, Ogg or .npy; they begin "
        "01 02), so its member would be named .image, which no decoder knows: rename the "
        "column after the format"
    )


def test_a_struct_without_a_path_and_unknown_bytes_is_refused(tmp_path: Path) -> None:
    raw = tmp_path / "a.parquet"
    cells = [{"bytes": b"plain text", "path": None}]
    pq.write_table(pa.table({"key": ["a"], "audio": pa.array(cells, STRUCT)}), raw)
    message = _refused(raw, tmp_path / "out")
    assert message.startswith(f"{raw}: row 0: column 'audio' holds bytes of no format")
    assert "and no path with an extension, so its member would be named .audio" in message
    assert "give the rows paths ending in their format's extension" in message


def test_a_column_mixing_formats_is_refused_naming_both_rows_and_files(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    for f, fmt in enumerate(("PNG", "JPEG")):
        cells = [{"bytes": picture(i, fmt), "path": None} for i in range(2)]
        table = {"key": [f"{f}-{i}" for i in range(2)], "image": pa.array(cells, STRUCT)}
        pq.write_table(pa.table(table), raw / f"part-{f}.parquet")
    message = _refused(raw, tmp_path / "out")
    assert message.startswith(
        f"{raw / 'part-1.parquet'}: row 0: column 'image' holds a .jpg payload, while row 0 "
        f"of {raw / 'part-0.parquet'} holds a .png; a column becomes one member field of every "
        "sample"
    )


def test_an_image_kept_outside_the_file_is_refused_not_dropped(tmp_path: Path) -> None:
    """``datasets`` writes an Image() loaded from a local file as its path alone (bytes null):
    the member was left out of the sample without a word."""
    datasets = pytest.importorskip("datasets")
    (tmp_path / "cat.jpg").write_bytes(picture(0, "JPEG"))
    rows = {"image": [str(tmp_path / "cat.jpg")], "key": ["a"], "thumb": [b"t"]}
    data = datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image())
    data.to_parquet(str(tmp_path / "train.parquet"))
    message = _refused(tmp_path / "train.parquet", tmp_path / "out")
    assert message.startswith(
        f"{tmp_path / 'train.parquet'}: row 0: column 'image' holds no bytes, only the path "
        f"{str(tmp_path / 'cat.jpg')!r}: the payload is outside the file"
    )


def test_null_cells_still_leave_the_member_out(tmp_path: Path) -> None:
    raw = tmp_path / "a.parquet"
    cells: list[Any] = [{"bytes": picture(0, "GIF"), "path": None}, None]
    table = {"key": ["a", "b"], "thumb": [b"1", b"2"], "image": pa.array(cells, STRUCT)}
    pq.write_table(pa.table(table), raw)
    shardprep.build(str(raw), str(tmp_path / "out"), shards=1, progress=False)
    got = shard_members(tmp_path / "out")[0]
    assert got == {"a": {"gif": picture(0, "GIF"), "thumb": b"1"}, "b": {"thumb": b"2"}}
