"""Feed JAX from a shardprep output with ``loader.core`` (no torch needed), with exact resume.

    python docs/examples/train_jax.py OUT --epochs 2 [--process-index I --process-count N]

Each JAX process (host) passes its own index and the process count, as
``tf.data``'s ``shard(num_shards, index)`` would take them; with
``jax.distributed`` use ``jax.process_index()`` and ``jax.process_count()``.
Every process takes exactly the same number of steps per epoch. The model
is logistic regression (one class against the rest) on a 16-bin byte
histogram of each sample's first data member, so it runs on any dataset.
Prints one JSON line per epoch: steps, the first and last loss, and the keys
this process trained on (for the test).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loader.core import ShardStream


def features(sample: dict[str, Any]) -> dict[str, Any]:
    """Per-sample transform: a 16-bin byte histogram and a 0/1 label, as NumPy values."""
    data = next(v for k, v in sample.items() if not k.startswith("__") and k != "cls")
    hist = np.bincount(np.frombuffer(data, dtype=np.uint8) // 16, minlength=16)
    return {
        "x": (hist / max(1, len(data))).astype(np.float32),
        "y": float(int(sample["cls"]) == 0),
        "__key__": sample["__key__"],
    }


def loss_fn(params: tuple[jax.Array, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    w, b = params
    logits = x @ w + b
    return jnp.mean(jnp.logaddexp(0.0, logits) - y * logits)


@jax.jit
def step(
    params: tuple[jax.Array, jax.Array], x: jax.Array, y: jax.Array
) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, params, grads), loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--process-index", type=int, default=0)
    parser.add_argument("--process-count", type=int, default=1)
    parser.add_argument("--start", type=int, default=0, help="batches of epoch 0 already trained")
    args = parser.parse_args()

    stream = ShardStream(args.out, batch_size=args.batch_size, decode=True, transform=features)
    params = (jnp.zeros(16), jnp.zeros(()))
    for epoch in range(args.epochs):
        losses, keys = [], []
        batches = stream.iterate(
            epoch,
            rank=args.process_index,
            world_size=args.process_count,
            start=args.start if epoch == 0 else 0,  # resume: skip what a checkpoint says
        )
        for batch in batches:
            params, loss = step(params, jnp.asarray(batch["x"]), jnp.asarray(batch["y"]))
            losses.append(float(loss))
            keys += batch["__key__"].tolist()
        print(json.dumps({"epoch": epoch, "steps": len(losses), "loss": losses[:1] + losses[-1:],
                          "keys": keys}))  # fmt: skip


if __name__ == "__main__":
    main()
