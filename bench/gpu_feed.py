"""How fast ShardDataset feeds a GPU: the loader → pinned memory → device copy path.

Run on a machine with a CUDA GPU (not part of ``python -m bench all``)::

    python -m bench.gpu_feed --work-dir /tmp/gpu-feed --samples 20000

Builds the ``images`` preset (30-100 KiB payloads), then for several
``num_workers`` streams one epoch through ``DataLoader(pin_memory=True,
persistent_workers=True)`` and copies every batch to the GPU with
``non_blocking=True``, where a reduction stands in for the model. Reports
samples/s, GB/s delivered to the device, and the share of wall time the GPU
stream spent waiting for data. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
import torch.utils.data

import shardprep
from bench.generate import Spec, generate
from loader import ShardDataset

PAYLOAD_BYTES = 32 << 10  # each sample is cut/padded to this many bytes on the host


def collate(batch: list[dict[str, Any]]) -> torch.Tensor:
    """Fixed-size uint8 rows (payload truncated or zero-padded), as an image pipeline's output."""
    out = torch.zeros(len(batch), PAYLOAD_BYTES, dtype=torch.uint8)
    for row, sample in enumerate(batch):
        data = next(v for k, v in sample.items() if not k.startswith("__") and k != "cls")
        view = torch.frombuffer(bytearray(data[:PAYLOAD_BYTES]), dtype=torch.uint8)
        out[row, : len(view)] = view
    return out


def epoch(out: str, workers: int, batch_size: int) -> dict[str, float]:
    """One epoch to the GPU; returns throughput figures."""
    device = torch.device("cuda")
    ds = ShardDataset(out)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=collate,
        pin_memory=True,
        persistent_workers=workers > 0,
    )
    for _ in loader:  # warm-up epoch: workers start, page cache fills
        pass
    ds.set_epoch(1)
    total = torch.zeros((), device=device, dtype=torch.int64)
    torch.cuda.synchronize()
    samples, start, waited = 0, time.perf_counter(), 0.0
    for batch in loader:
        t = time.perf_counter()
        x = batch.to(device, non_blocking=True)
        total += x.sum(dtype=torch.int64)  # stand-in for the model's work
        samples += len(batch)
        waited += time.perf_counter() - t
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {
        "workers": workers,
        "samples_s": samples / elapsed,
        "gb_s": samples * PAYLOAD_BYTES / elapsed / 1e9,
        "copy_share": waited / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default="/tmp/gpu-feed")
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", default="0,2,4,8")
    args = parser.parse_args()
    work = Path(args.work_dir)
    raw = generate(Spec("images", args.samples), work / "data")
    out = work / "shards"
    if not (out / "manifest.json").exists():
        shardprep.build(str(raw), str(out), shards=16, workers=8, progress=False, overwrite=True)
    print(
        f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"{args.samples} samples, batch {args.batch_size}, {PAYLOAD_BYTES // 1024} KiB per sample on device"
    )
    print("| num_workers | samples/s | GB/s to GPU | time in copy+launch |")
    print("|---:|---:|---:|---:|")
    for workers in (int(w) for w in args.workers.split(",")):
        r = epoch(str(out), workers, args.batch_size)
        print(f"| {workers} | {r['samples_s']:,.0f} | {r['gb_s']:.2f} | {r['copy_share']:.0%} |")


if __name__ == "__main__":
    main()
