"""Decode: opt-in conversion of raw member bytes by extension. Safe by default.

Nothing is decoded unless asked (``decode=True`` or a mapping). Pickle and
torch-serialized members (``.pickle``, ``.pkl``, ``.pyd``, ``.pth``, ``.pt``)
are refused unless ``allow_pickle=True``: unpickling runs arbitrary code from
the shard.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Decoder", "default_decoders", "make_decoder"]

UNSAFE_EXTS = frozenset({"pickle", "pkl", "pyd", "pth", "pt"})
IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "bmp", "gif", "tif", "tiff", "webp", "ppm", "pgm"})
AUDIO_EXTS = frozenset({"wav", "flac", "ogg", "mp3", "opus"})

Decoder = Callable[[dict[str, Any]], dict[str, Any]]


def _npy(data: bytes) -> Any:
    import numpy as np

    return np.load(io.BytesIO(data), allow_pickle=False)


def _image(data: bytes) -> Any:
    """A uint8 array of shape (channels, height, width), as torchvision's ``decode_image`` lays it out."""
    try:
        from PIL import Image
    except ImportError as err:
        raise ImportError("decoding images needs Pillow: pip install pillow") from err
    import numpy as np

    with Image.open(io.BytesIO(data)) as image:
        if image.mode in ("1", "P", "CMYK", "YCbCr", "LAB", "HSV"):
            image = image.convert("RGBA" if "transparency" in image.info else "RGB")
        elif image.mode not in ("L", "LA", "RGB", "RGBA"):
            raise ValueError(
                f"a {image.mode} image has no 8-bit tensor form: pass decode={{ext: fn}} for it"
            )
        pixels = np.array(image)
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def _audio(data: bytes) -> tuple[Any, int]:
    """(waveform, sample rate): a float32 array of shape (channels, frames) in [-1, 1], as
    ``torchaudio.load`` gives it, read with soundfile (libsndfile: WAV, FLAC, Ogg, MP3)."""
    try:
        import soundfile
    except ImportError as err:
        raise ImportError(
            "decoding audio needs soundfile: pip install 'shardprep[audio]' (or pass "
            "decode={ext: fn} for these members)"
        ) from err
    import numpy as np

    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return np.ascontiguousarray(samples.T), int(rate)


def _pickle(data: bytes) -> Any:
    import pickle

    return pickle.loads(data)  # noqa: S301 - only reachable with allow_pickle=True


def _torch(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def default_decoders(
    image: Callable[[Any], Any] | None = None,
) -> dict[str, Callable[[bytes], Any]]:
    """Built-in decoders: ``cls``→int, ``txt``→str, ``json``→object, ``npy``→array, images→uint8 CHW,
    audio→(float32 (channels, frames), sample rate).

    Images and waveforms are NumPy arrays, or ``image(array)`` when given (the torch layer
    makes tensors of them: ``loader.read.output.Output.image``).
    """
    decoders: dict[str, Callable[[bytes], Any]] = {
        "cls": lambda b: int(b),
        "txt": lambda b: b.decode("utf-8"),
        "json": json.loads,
        "npy": _npy,
        "weight": lambda b: float(b),
    }
    if image is None:
        decoders.update(dict.fromkeys(IMAGE_EXTS, _image))
    else:
        decoders.update(dict.fromkeys(IMAGE_EXTS, lambda b: image(_image(b))))
    if image is None:
        decoders.update(dict.fromkeys(AUDIO_EXTS, _audio))
    else:

        def audio(data: bytes) -> tuple[Any, int]:
            waveform, rate = _audio(data)
            return image(waveform), rate

        decoders.update(dict.fromkeys(AUDIO_EXTS, audio))
    return decoders


def make_decoder(
    decode: bool | Mapping[str, Callable[[bytes], Any]],
    allow_pickle: bool = False,
    image: Callable[[Any], Any] | None = None,
) -> Decoder | None:
    """A function decoding a sample dict in place of raw bytes, or None for raw bytes.

    Matching uses the last part of the extension (``seg.png`` decodes as ``png``);
    ``image`` converts a decoded image array (see ``default_decoders``).
    """
    if decode is False:
        return None
    table = default_decoders(image)
    if allow_pickle:
        table.update(
            {"pickle": _pickle, "pkl": _pickle, "pyd": _pickle, "pth": _torch, "pt": _torch}
        )
    if isinstance(decode, Mapping):
        table.update(decode)

    def decoder(sample: dict[str, Any]) -> dict[str, Any]:
        for ext, value in sample.items():
            if ext.startswith("__") or not isinstance(value, bytes):
                continue
            last = ext.rsplit(".", 1)[-1].lower()
            fn = table.get(ext) or table.get(last)
            if fn is not None:
                sample[ext] = fn(value)
            elif last in UNSAFE_EXTS:
                raise ValueError(
                    f"sample {sample['__key__']!r}: refusing to decode .{ext} (pickle can run "
                    "code); pass allow_pickle=True if you trust these shards"
                )
        return sample

    return decoder
