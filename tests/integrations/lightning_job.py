"""A 2-process Lightning DDP job (CPU, gloo) over a shardprep output; run by test_lightning.py.

Lightning's ddp strategy re-launches this script for rank 1, so it must be a
real file. It stays import-free at the top: on Python 3.11 a forkserver
DataLoader worker re-runs the main script before it starts (the server never
preloads ``__main__``, python/cpython#126631), so heavy imports here would be
paid again by every worker of every epoch. The job is in ``lightning_recorder``.
"""

if __name__ == "__main__":
    from tests.integrations.lightning_recorder import main

    main()
