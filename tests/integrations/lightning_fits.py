"""The fits of ``lightning_recorder`` (``FITS``, ``ELASTIC``) and their constants, without Lightning.

test_lightning.py reads these to check what each fit trained on; kept apart from the recorder so
that collecting the tests does not import Lightning (about 5 s per pytest process on 2 cores).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

BATCH_SIZE = 32
NUM_WORKERS = 2
EPOCHS = 2
STOP_AT_STEP = 20  # the interrupted fit stops here, in the middle of epoch 1
SAVE_EVERY = 5  # and checkpoints every 5 steps: step=15 is the last batch of epoch 0
DATASET_OPTIONS: dict[str, Any] = {
    "batch_size": BATCH_SIZE,
    "shuffle_buffer": 128,
    "block_size": 64,
}


@dataclass(frozen=True)
class Fit:
    """One ``Trainer.fit``: its DataLoader, where the dataset is built, and what it resumes."""

    stateful: bool = False  # torchdata StatefulDataLoader (Lightning checkpoints its state)
    build_in_init: bool = False  # ShardDataset built in the module's __init__, before DDP starts
    persistent: bool = False  # persistent DataLoader workers
    hooks: bool = False  # keep ds.state_after(last batch) in the checkpoint; resume from it
    # the docs' Lightning recipe: train_dataloader() sets the epoch Lightning's fit loop is about
    # to run, so that a fit resumed from an epoch-end checkpoint does not replay epoch 0's order
    epoch_hook: bool = False
    stop: bool = False  # stop at stop_at, checkpointing every SAVE_EVERY steps and epoch
    stop_at: int = STOP_AT_STEP
    resume: tuple[str, str] | None = None  # (a "stop" fit, its checkpoint file) to resume from
    epochs: int = EPOCHS  # max_epochs
    refused: bool = False  # the fit must fail: each rank records its error instead of steps


# the docs' StatefulDataLoader recipe: Lightning restores the loader state, and the checkpoint
# also keeps ds.state_after(last trained batch), given to ds.resume() in train_dataloader(): len()
# then counts the resumed epoch at this world before Lightning reads it, and that position wins
# over the loader state (saved one batch ahead where Lightning fetched ahead: no len())
STATEFUL = Fit(stateful=True, epoch_hook=True, hooks=True)
HOOKS = Fit(hooks=True)  # the docs' plain-DataLoader recipe (state_after / resume)
ELASTIC_EPOCHS = EPOCHS + 1  # a resume at another world runs one normal epoch after its own
CHAIN_STOP = STOP_AT_STEP + SAVE_EVERY  # a 3-rank fit resumed at step 20 stops here, in epoch 1

FITS: dict[str, Fit] = {
    # uninterrupted, 2 epochs: the reference for every resume below
    "plain": Fit(build_in_init=True, persistent=True),
    # interrupted at step 20 (mid-epoch 1), then resumed from its checkpoints
    "stop-stateful": replace(STATEFUL, stop=True),
    "stateful-from-step20": replace(STATEFUL, resume=("stop-stateful", "step=20.ckpt")),
    "stateful-from-step15": replace(STATEFUL, resume=("stop-stateful", "step=15.ckpt")),
    "stateful-from-epoch-end": replace(STATEFUL, resume=("stop-stateful", "epoch=0-end.ckpt")),
    "stop-hooks": replace(HOOKS, stop=True),
    "hooks-from-step20": replace(HOOKS, resume=("stop-hooks", "step=20.ckpt")),
    "hooks-from-step15": replace(HOOKS, resume=("stop-hooks", "step=15.ckpt")),
    "hooks-from-epoch-end": replace(HOOKS, resume=("stop-hooks", "epoch=0-end.ckpt")),
}

# Elastic resume (test_lightning.py runs one job per world size). At 3 ranks: the 2-rank
# checkpoints at step 20 resumed by both recipes, the StatefulDataLoader recipe without
# its on_load_checkpoint hook (refused: last, the fit fails), and both recipes interrupted
# at step 20, whose step-15 checkpoints (mid-epoch 1 at 3 ranks) the 2-rank job resumes.
# (A 2 -> 4 resume is the same case as 2 -> 3 here, a resumed epoch longer than a normal one at
# the new world; 2 -> 4 on real ranks: tests/distributed/test_elastic_ddp.py.)
ELASTIC: dict[int, dict[str, Fit]] = {
    3: {
        "stateful-at3": replace(
            STATEFUL, resume=("stop-stateful", "step=20.ckpt"), epochs=ELASTIC_EPOCHS
        ),
        "hooks-at3": replace(HOOKS, resume=("stop-hooks", "step=20.ckpt"), epochs=ELASTIC_EPOCHS),
        "stop-stateful-at3": replace(STATEFUL, stop=True),
        "stop-hooks-at3": replace(HOOKS, stop=True),
        "refused-at3": replace(
            STATEFUL, hooks=False, resume=("stop-stateful", "step=20.ckpt"), refused=True
        ),
        # restarted again inside the resumed epoch (5 of its 7 batches), where Lightning
        # fetched a batch ahead; resumed by the 2-rank job ("stateful-chain2")
        "stop-stateful-chain3": replace(
            STATEFUL, resume=("stop-stateful", "step=20.ckpt"), stop=True, stop_at=CHAIN_STOP
        ),
    },
    2: {
        "stateful-from3": replace(
            STATEFUL, resume=("stop-stateful-at3", "step=15.ckpt"), epochs=ELASTIC_EPOCHS
        ),
        "hooks-from3": replace(
            HOOKS, resume=("stop-hooks-at3", "step=15.ckpt"), epochs=ELASTIC_EPOCHS
        ),
        # the rest of epoch 1 only
        "stateful-chain2": replace(
            STATEFUL, resume=("stop-stateful-chain3", f"step={CHAIN_STOP}.ckpt")
        ),
    },
}
ALL_FITS = {**FITS, **{name: fit for fits in ELASTIC.values() for name, fit in fits.items()}}
