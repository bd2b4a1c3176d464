"""Train a tiny classifier with DDP on a shardprep output, with exact mid-epoch resume.

    torchrun --standalone --nproc-per-node 2 docs/examples/train_ddp.py OUT --epochs 2

Runs on CPU (gloo) or GPUs (nccl). The features are a 16-bin byte histogram
of each sample's first data member, so it works on any dataset; replace
``features()`` and the model with your own. Rank 0 writes a checkpoint with
the model, the optimizer and the loader state every ``--save-every`` steps
and at the end of each epoch; rerunning the same command resumes exactly
where the checkpoint left off.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.data
from torch.nn.parallel import DistributedDataParallel

from loader import ShardDataset


def features(sample: dict[str, Any]) -> torch.Tensor:
    """A 16-bin histogram of the bytes of the sample's first data member."""
    data = next(v for k, v in sample.items() if not k.startswith("__") and k != "cls")
    counts = torch.bincount(
        torch.frombuffer(bytearray(data), dtype=torch.uint8) // 16, minlength=16
    )
    return counts.float() / max(1, len(data))


def with_features(sample: dict[str, Any]) -> dict[str, Any]:
    """Per-sample transform: add the model's input; ShardDataset then batches the dicts."""
    return {"x": features(sample), "y": int(sample["cls"]), "__padded__": sample["__padded__"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="a shardprep output folder")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--checkpoint", default="checkpoint.pt")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    device = torch.device(
        f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if backend == "nccl" else "cpu"
    )

    # Whole batches are made in the workers: the DataLoader gets batch_size=None, and every rank
    # then receives exactly len(loader) batches. Rank and world size come from torch.distributed.
    dataset = ShardDataset(args.out, batch_size=args.batch_size, transform=with_features)
    num_classes = len(dataset.manifest.class_names or ()) or 1
    model = DistributedDataParallel(torch.nn.Linear(16, num_classes).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=None,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        # fork() inside a process with gloo/nccl threads can deadlock on CPython 3.11
        multiprocessing_context="forkserver" if args.workers > 0 else None,
        pin_memory=backend == "nccl",
    )

    start_epoch = 0
    if os.path.exists(args.checkpoint):
        checkpoint = torch.load(args.checkpoint, map_location=device, weights_only=False)
        model.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        state = checkpoint["data"]
        dataset.resume(state)  # the next pass continues that epoch after its consumed batches
        start_epoch = state["epoch"]
        if state["batches"] == len(loader):  # saved at the end of an epoch
            start_epoch += 1
        if rank == 0:
            print(f"resumed at epoch {start_epoch}, {state['batches'] % len(loader)} batches in")

    def save(state: dict[str, Any]) -> None:
        if rank == 0:  # the loader state is identical on every rank
            torch.save(
                {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "data": state,
                },
                args.checkpoint + ".tmp",
            )
            os.replace(args.checkpoint + ".tmp", args.checkpoint)

    for epoch in range(start_epoch, args.epochs):
        dataset.set_epoch(
            epoch
        )  # optional (epochs advance by themselves); keeps a resume of `epoch`
        seen = torch.zeros(1)
        for step, batch in enumerate(loader, start=1):
            x, y = batch["x"].to(device), batch["y"].to(device)
            mask = (~batch["__padded__"]).float().to(device)  # padded repeats do not count
            loss = (F.cross_entropy(model(x), y, reduction="none") * mask).sum() / mask.sum().clamp(
                min=1
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += mask.sum().cpu()
            if step % args.save_every == 0 or step == len(loader):
                save(dataset.state_after(batch))  # the position comes from the batch itself
        dist.all_reduce(seen)
        if rank == 0:
            print(
                f"epoch {epoch}: loss {loss.item():.3f}, {int(seen.item())} samples over all ranks"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
