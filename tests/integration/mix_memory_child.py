"""Child of test_mix_memory: a MixedDataset epoch of N samples, its first batches, peak RSS.

``python -m tests.integration.mix_memory_child OUT_A OUT_B N BATCHING`` prints one
JSON line: the peak RSS (VmHWM; ru_maxrss as well), the seconds to the first batch, ``len(ds)``, and
the batches a resume near the epoch's end gives.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import torch.utils.data

from loader.torch.mixdataset import MixedDataset


def main(first: str, second: str, samples: int, batching: str) -> dict[str, object]:
    def make() -> MixedDataset:
        return MixedDataset([first, second], [1, 3], batch_size=32, samples_per_epoch=samples,
                            batching=batching, seed=5, rank=0, world_size=1)  # fmt: skip

    started = time.perf_counter()
    ds = make()
    iterator = iter(torch.utils.data.DataLoader(ds, batch_size=None))
    batch = next(iterator)
    first_batch_s = time.perf_counter() - started
    taken = [batch] + [next(iterator) for _ in range(4)]
    assert [b["__position__"]["batch"] for b in taken] == [0, 1, 2, 3, 4]
    assert all(len(b["__key__"]) == 32 for b in taken)
    # resume a few batches before the end (mixed: O(log J); per_source replays the interleave,
    # so only where that is cheap)
    batches = len(ds)
    at = batches - 2 if batching == "mixed" else min(batches - 2, 200_000)
    resumed = make()
    resumed.resume(resumed.state_after({"__position__": {"epoch": 0, "batch": at - 1,
                                                         "num_workers": 1}}))  # fmt: skip
    started = time.perf_counter()
    rest = iter(torch.utils.data.DataLoader(resumed, batch_size=None))
    after = [next(rest)["__position__"]["batch"] for _ in range(2)]
    resume_s = time.perf_counter() - started
    return {
        "samples": samples,
        "batching": batching,
        "len": batches,
        "counts": ds.stream.counts(1),
        "first_batch_s": first_batch_s,
        "resume_at": at,
        "resumed": after,
        "resume_s": resume_s,
        "peak_rss_kib": _peak_rss_kib(),
        # ru_maxrss keeps the forking parent's peak across exec (Linux): only a floor here
        "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


def _peak_rss_kib() -> int:
    """This process's own peak RSS (VmHWM), which exec resets, unlike ru_maxrss."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])))
