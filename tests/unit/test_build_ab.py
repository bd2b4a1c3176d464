"""bench.build_ab's pure parts: the round-robin order, the spread and the paired ratios."""

from __future__ import annotations

from typing import Any

from bench.build_ab import Spread, figures, paired_ratios, render, round_order, spread

NAMES = [f"v{i}" for i in range(12)]


def test_every_round_runs_every_variant_once_in_rotated_order() -> None:
    orders = [round_order(NAMES, r, 3) for r in range(3)]
    assert orders[0] == NAMES
    assert orders[1] == NAMES[4:] + NAMES[:4]
    assert orders[2] == NAMES[8:] + NAMES[:8]
    for order in orders:
        assert sorted(order) == sorted(NAMES)
    # each variant runs in a different third of the round each time
    for name in NAMES:
        assert sorted(o.index(name) // 4 for o in orders) == [0, 1, 2]


def test_round_order_more_rounds_than_variants_and_empty() -> None:
    assert [round_order(["a", "b"], r, 5)[0] for r in range(5)] == ["a", "a", "a", "b", "b"]
    assert round_order([], 2, 3) == []


def test_spread_is_median_min_max() -> None:
    assert spread([3.0, 1.0, 10.0]) == Spread(3.0, 1.0, 10.0, 3)
    assert spread([2.0, 4.0]) == Spread(3.0, 2.0, 4.0, 2)
    assert spread([]) is None


def _run(variant: str, rnd: int, files_s: float, **kw: Any) -> dict[str, Any]:
    return {"variant": variant, "round": rnd, "files_s": files_s, **kw}


def test_ratios_pair_runs_of_the_same_round_and_skip_errors() -> None:
    runs = [
        _run("sp", 1, 300.0),
        _run("peer", 0, 50.0),
        _run("sp", 0, 100.0),
        _run("peer", 1, 100.0),
        _run("sp", 2, 90.0),
        {"variant": "peer", "round": 2, "error": "exit 1: boom"},
    ]
    assert paired_ratios(runs, "sp", "peer", "files_s") == [2.0, 3.0]
    assert figures(runs, "sp", "files_s") == [100.0, 300.0, 90.0]
    assert figures(runs, "peer", "files_s") == [50.0, 100.0]


def test_render_shows_median_range_ratios_and_errors() -> None:
    fig = {"mb_s": 1.0, "cpu_s": 1.0, "peak_pss": 2**20, "out_bytes": 10**6, "disk_bytes": 0}
    runs = [
        _run("tar cf (floor)", 0, 1000.0, elapsed_s=1.0, load1=0.5, **fig),
        _run("tar cf (floor)", 1, 800.0, elapsed_s=1.25, load1=1.5, **fig),
        _run("shardprep w1", 0, 500.0, elapsed_s=2.0, load1=0.7, late_imports=[], **fig),
        _run("shardprep w1", 1, 600.0, elapsed_s=1.5, load1=0.9, late_imports=["x"], **fig),
        _run("MDSWriter", 0, 250.0, elapsed_s=4.0, load1=0.6, **fig),
        {"variant": "MDSWriter", "round": 1, "pos": 2, "load1": 1.0, "error": "exit 1: no lib"},
    ]
    for i, r in enumerate(runs):
        r.setdefault("pos", i % 3)
    result = {
        "dataset": "small",
        "shards": 16,
        "rounds": 2,
        "variants": ["tar cf (floor)", "shardprep w1", "MDSWriter"],
        "orders": [["tar cf (floor)"], ["shardprep w1"]],
        "runs": runs,
        "meta": {"n": 1000, "total_bytes": 10**6},
        "machine": {
            "cpu": "CPU X",
            "cores": 2,
            "ram_gib": 8.0,
            "python": "3.11.7",
            "packages": "torch 2",
            "commit": "abc",
        },
        "python": "/py",
        "command": "python -m bench.build_ab --raw R --dataset small",
        "started": "t0",
        "finished": "t1",
    }
    md = render(result)
    assert "Command: `python -m bench.build_ab --raw R --dataset small`" in md
    assert "load average before each run 0.50–1.50" in md
    assert "| tar cf (floor) | 900 (800–1,000) |" in md
    # shardprep/tar per round: 500/1000 = 0.5, 600/800 = 0.75 -> median 0.625
    row = "| shardprep w1 | 550 (500–600) | 1 | 1.75 (1.5–2) | 1 | 0.625× (0.5–0.75) | 1 | - | 1 | 0 |"
    assert row in md
    assert "| MDSWriter | n/a: exit 1: no lib | - | - | - | - | - | - | - | - |\n" in md
    assert "files/s moved by 2× or more" not in md
    runs[1]["files_s"] = 400.0  # tar: 1000 then 400 -> 2.5x apart
    assert "files/s moved by 2× or more between rounds: tar cf (floor)." in render(result)
    # the only round where both ran without error: 500 / 250
    assert "| shardprep w1 | MDSWriter | 2× |" in md
    assert "| 2 | 1 | shardprep w1 | 1.50 | 600 | 1.00 | 1 | 0.90 | x |" in md
    assert "| 2 | 3 | MDSWriter | error | - | - | - | - | - |" in md
    # every table row has as many cells as its header
    for table in md.split("\n\n"):
        rows = [ln for ln in table.splitlines() if ln.startswith("|")]
        assert len({len(ln.strip().strip("|").split("|")) for ln in rows}) <= 1, table
