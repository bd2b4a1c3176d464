"""Train a small image classifier with DDP on a shardprep output, with exact mid-epoch resume.

    shardprep example /tmp/shardprep-raw
    shardprep build /tmp/shardprep-raw /tmp/shardprep-out --shards 8
    torchrun --standalone --nproc-per-node 2 docs/examples/train_ddp.py /tmp/shardprep-out

Runs on CPU (gloo) or GPUs (nccl). The images are decoded in the DataLoader
workers (``decode=True``: a PNG becomes a ``(3, H, W)`` uint8 tensor, a batch
``(B, 3, H, W)``), so any output of same-sized images with a class label
works; on ``shardprep example``'s images, 2 epochs reach about 95% accuracy.
After training, every sample of the output is scored exactly once
(``uneven="pad"``: the repeats that even out the ranks are flagged and not
counted).

With ``--checkpoint PATH``, rank 0 saves the model, the optimizer and the
loader state there every ``--save-every`` steps and at the end of each epoch,
and a run that finds the file resumes exactly where it left off (a finished
run trains nothing more). A checkpoint of another build is refused.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.data
from torch.nn.parallel import DistributedDataParallel

from loader import ShardDataset


def image_of(batch: dict[str, Any]) -> torch.Tensor:
    """The batch's image member (the first uint8 tensor of shape (B, C, H, W)) as floats."""
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 4:
            return value.float() / 255.0
    raise SystemExit(f"no image member in the batch (members: {sorted(batch)}); see the docstring")


def make_model(num_classes: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, num_classes),
    )


def make_loader(dataset: ShardDataset, workers: int, pin: bool) -> torch.utils.data.DataLoader:
    # Whole batches are made in the workers: the DataLoader gets batch_size=None, and every rank
    # then receives exactly len(loader) batches. Rank and world size come from torch.distributed.
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=None,
        num_workers=workers,
        persistent_workers=workers > 0,
        # fork() inside a process with gloo/nccl threads can deadlock on CPython 3.11
        multiprocessing_context="forkserver" if workers > 0 else None,
        pin_memory=pin,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="a shardprep output folder (or URL)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--checkpoint", help="save here, and resume from here if it exists")
    parser.add_argument("--save-every", type=int, default=5, help="checkpoint every N steps")
    args = parser.parse_args()
    # The forkserver workers below fork from a server that imported torch and the loader once,
    # instead of each importing them again (docs/integrations.md, "Workers inside
    # torch.distributed processes").
    multiprocessing.set_forkserver_preload(["loader.torch.dataset"])

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    device = torch.device(
        f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if backend == "nccl" else "cpu"
    )
    torch.manual_seed(0)  # the same initial model on every rank

    dataset = ShardDataset(args.out, batch_size=args.batch_size, decode=True)
    build = dataset.manifest.fingerprint
    num_classes = len(dataset.manifest.class_names or ()) or 1
    model = DistributedDataParallel(make_model(num_classes).to(device))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loader = make_loader(dataset, args.workers, pin=backend == "nccl")

    if args.checkpoint and os.path.exists(args.checkpoint):
        checkpoint = torch.load(args.checkpoint, map_location=device, weights_only=True)
        if checkpoint["build"] != build:
            sys.exit(
                f"{args.checkpoint}: a checkpoint of another build (not {args.out}); "
                "pass another --checkpoint path, or delete it to start over"
                if rank == 0
                else 1
            )
        model.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        dataset.resume(checkpoint["data"])  # the next pass continues after the consumed batches
        if rank == 0:
            print(f"resumed from {args.checkpoint}: epoch {dataset.epoch} comes next")

    def save(state: dict[str, Any]) -> None:
        if rank == 0 and args.checkpoint:  # the loader state is identical on every rank
            content = {
                "build": build,
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "data": state,
            }
            torch.save(content, args.checkpoint + ".tmp")
            os.replace(args.checkpoint + ".tmp", args.checkpoint)

    # dataset.epoch: the epoch the next pass streams (after a resume: the saved one if it was
    # left mid-way, else the one after it); a resumed pass yields only the batches not yet seen.
    for epoch in range(dataset.epoch, args.epochs):
        model.train()
        for step, batch in enumerate(loader, start=1):
            x, y = image_of(batch).to(device), batch["cls"].to(device)
            mask = (~batch["__padded__"]).float().to(device)  # padded repeats do not count
            loss = (F.cross_entropy(model(x), y, reduction="none") * mask).sum()
            loss = loss / mask.sum().clamp(min=1)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % args.save_every == 0:
                save(dataset.state_after(batch))  # the position comes from the batch itself
        save(dataset.state_after(batch))  # the epoch's last batch: a resume starts the next epoch
        if rank == 0:
            print(f"epoch {epoch}: {step} batches, last loss {loss.item():.3f}")

    # Score every sample once: uneven="pad" gives each rank the same count, padding with flagged
    # repeats that are not counted; no shuffle needed.
    scoring = ShardDataset(args.out, batch_size=64, decode=True, uneven="pad", shuffle=False)
    model.eval()
    counts = torch.zeros(2)
    with torch.no_grad():
        for batch in make_loader(scoring, args.workers, pin=False):
            real = ~batch["__padded__"]
            predicted = model(image_of(batch).to(device)).argmax(1).cpu()
            right = ((predicted == batch["cls"]) & real).sum()
            counts += torch.tensor([float(right), float(real.sum())])
    dist.all_reduce(counts)
    if rank == 0:
        right, total = int(counts[0]), int(counts[1])
        print(f"accuracy {right / max(1, total):.3f} ({right} of {total} samples)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
