"""docs/loader.md's Lightning recipe for epoch telemetry, run by a real Lightning Trainer (one
CPU process, 2 DataLoader workers): each epoch's ``epoch_stats()`` is logged with exact counts
and the loop's wait seen through ``ds.timed(loader)``."""

from __future__ import annotations

from pathlib import Path

import pytest

# Lightning's own use of torch's pytree (not ours; its other tests run in subprocesses)
pytestmark = pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning")


def test_the_lightning_recipe_logs_each_epoch(built: Path, tmp_path: Path) -> None:
    import lightning as L  # (here, not at collection: see lightning_telemetry.py)

    from tests.unit.lightning_telemetry import Model

    model = Model(str(built))
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model)
    assert [(d["epoch"], d["samples"], d["batches"]) for d in model.logged] == [
        (0, 103, 13),
        (1, 103, 13),
    ]
    assert all(d["wait_s"] > 0 and d["compute_s"] > 0 for d in model.logged)
    assert trainer.logged_metrics["samples"] == 103
    assert trainer.num_training_batches == 13  # len() reached Lightning through timed()
