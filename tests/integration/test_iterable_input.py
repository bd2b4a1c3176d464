"""End to end: ``shardprep.build(samples, OUT)`` from a generator, a list and a real
``datasets.Dataset``, read back with the loader; the same guarantees as a file build."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import shardprep
from loader import ShardDataset
from shardprep.builder import JOURNAL_NAME
from shardprep.format.errors import InputError
from shardprep.format.shardformat import decode_index
from tests.integration.iterable_samples import CLASSES, class_of, sample, samples
from tests.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]
COUNT, SHARDS = 1000, 7


def _hashes(folder: Path) -> dict[str, str]:
    """Every file in ``folder`` (hidden ones included) -> sha256."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _json_bytes(value: dict[str, Any]) -> bytes:
    """What a dict member is written as (sorted keys, no spaces, UTF-8)."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def _expected(i: int) -> dict[str, bytes]:
    """Sample ``i``'s members as the loader must hand them out (``.cls`` its class index)."""
    s = sample(i)
    return {
        "jpg": s["jpg"],
        "json": _json_bytes(s["json"]),
        "txt": s["txt"].encode(),
        "cls": str(CLASSES.index(class_of(i))).encode(),
    }


def _read_back(out: Path) -> dict[str, dict[str, bytes]]:
    """key -> members, every sample of ``out`` through the loader (checksums on)."""
    got: dict[str, dict[str, bytes]] = {}
    for s in ShardDataset(str(out), shuffle=False):
        key = s["__key__"]
        assert key not in got, f"{key} read twice"
        got[key] = {k: v for k, v in s.items() if not k.startswith("__")}
    return got


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generator of 1,000 samples with string classes, built into 7 shards (2 workers)."""
    out = tmp_path_factory.mktemp("iterable") / "out"
    summary = shardprep.build(samples(COUNT), str(out), shards=SHARDS, workers=2, progress=False)
    assert summary.layout == "iterable" and not summary.layout_detected
    assert (summary.num_samples, summary.num_shards, summary.num_classes) == (COUNT, SHARDS, 3)
    return out


def test_generator_counts_stratification_and_bytes(built: Path) -> None:
    manifest = json.loads((built / "manifest.json").read_text())
    assert [c["name"] for c in manifest["classes"]] == ["cat", "dog", "eel"]  # sorted names
    assert [c["count"] for c in manifest["classes"]] == [500, 300, 200]
    sizes = sorted(s["num_samples"] for s in manifest["shards"])
    assert sizes == [142] + [143] * 6  # exactly 7 shards, counts within 1
    for label, total in enumerate((500, 300, 200)):  # every class spread within 1 per shard
        per_shard = [s["class_counts"][label] for s in manifest["shards"]]
        assert sum(per_shard) == total
        assert max(per_shard) - min(per_shard) <= 1, (label, per_shard)
    got = _read_back(built)
    assert sorted(got) == [f"s{i:05d}" for i in range(COUNT)]
    for i in range(COUNT):
        assert got[f"s{i:05d}"] == _expected(i), i


def test_byte_identical_across_builds_and_workers(built: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    one = tmp_path / "one"
    shardprep.build(samples(COUNT), str(again), shards=SHARDS, workers=2, progress=False)
    shardprep.build(list(samples(COUNT)), str(one), shards=SHARDS, workers=1, progress=False)
    assert _hashes(again) == _hashes(built)
    assert _hashes(one) == _hashes(built)


def test_dict_insertion_order_does_not_change_the_bytes(built: Path, tmp_path: Path) -> None:
    def reordered() -> Iterator[dict[str, Any]]:
        for s in samples(COUNT):
            yield {k: s[k] for k in reversed(list(s))} | {"__url__": "ignored"}

    out = tmp_path / "out"
    shardprep.build(reordered(), str(out), shards=SHARDS, workers=2, progress=False)
    assert _hashes(out) == _hashes(built)


def _write_keyed(folder: Path, count: int) -> Path:
    """The same samples as keyed files: ``<key>.jpg/.json/.txt`` and ``<key>.cls`` (the name)."""
    folder.mkdir()
    for i in range(count):
        key, expected = f"s{i:05d}", _expected(i)
        for ext in ("jpg", "json", "txt"):
            (folder / f"{key}.{ext}").write_bytes(expected[ext])
        (folder / f"{key}.cls").write_text(class_of(i))
    return folder


def _shard_tars(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard-*.tar"))}


@pytest.mark.parametrize(
    "weights", [{}, {"class_weights": "cat=1,dog=1,eel=2", "num_samples": 900}]
)
def test_same_shards_as_the_samples_written_as_files(
    weights: dict[str, Any], tmp_path: Path
) -> None:
    """The shard tars equal those of a keyed-file build of the same samples (the indexes
    differ only in the sources they record); class weighting included."""
    raw = _write_keyed(tmp_path / "raw", COUNT)
    files, code = tmp_path / "files", tmp_path / "code"
    options: dict[str, Any] = {"shards": SHARDS, "workers": 2, "progress": False, **weights}
    from_files = shardprep.build(str(raw), str(files), input_format="keyed", **options)
    from_code = shardprep.build(samples(COUNT), str(code), **options)
    assert from_code.num_samples == from_files.num_samples
    assert _shard_tars(code) == _shard_tars(files)
    assert len(_shard_tars(code)) == SHARDS
    manifests = [json.loads((o / "manifest.json").read_text()) for o in (files, code)]
    assert manifests[0]["classes"] == manifests[1]["classes"]
    assert manifests[0].get("class_weighting") == manifests[1].get("class_weighting")
    got = [s["__key__"] for s in ShardDataset(str(code), shuffle=False)]
    if weights:  # 900 samples, eel weighted 2:1:1 -> 450 eel copies from 200 originals
        counts = Counter(class_of(int(key[1:6])) for key in got)
        assert counts == {"cat": 225, "dog": 225, "eel": 450}
        assert manifests[1]["class_weighting"]["realized_counts"] == [225, 225, 450]
    else:
        assert len(got) == COUNT


def test_hugging_face_dataset_gives_the_same_tree_as_a_generator(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    count = 300
    rows = [sample(i, label=CLASSES.index(class_of(i))) for i in range(count)]  # int classes
    columns = {name: [row[name] for row in rows] for name in rows[0]}
    dataset = datasets.Dataset.from_dict(columns)
    assert isinstance(dataset, datasets.Dataset) and len(dataset) == count
    hf, gen = tmp_path / "hf", tmp_path / "gen"
    summary = shardprep.build(dataset, str(hf), shards=5, workers=2, progress=False)
    shardprep.build(iter(rows), str(gen), shards=5, workers=2, progress=False)
    assert summary.num_samples == count
    assert _hashes(hf) == _hashes(gen)
    manifest = json.loads((hf / "manifest.json").read_text())
    assert [c["name"] for c in manifest["classes"]] == ["0", "1", "2"]  # ints are indices
    got = _read_back(hf)
    for i in range(count):
        assert got[f"s{i:05d}"] == _expected(i), i


def test_progress_bar_shows_the_spill(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shardprep.build(list(samples(50)), str(tmp_path / "out"), shards=2, workers=1)
    err = capsys.readouterr().err
    assert "spill samples: 100%" in err and "50/50" in err  # a list has a length: a total
    assert "write: 100%" in err


def test_memory_stays_bounded_for_large_payloads(tmp_path: Path) -> None:
    """96 samples of 4 MiB (384 MiB) through a child process: neither it nor its workers hold
    more than a few samples at once."""
    count, size = 96, 4 << 20
    out = tmp_path / "out"
    done = run_bounded(
        [sys.executable, "-m", "tests.integration.iterable_samples", "memory", str(out),
         str(count), str(size)],
        timeout=240,
        cwd=REPO,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    total_mib = count * size >> 20
    grown_mib = (peaks["after_kib"] - peaks["before_kib"]) >> 10
    assert grown_mib < 64, (grown_mib, total_mib, peaks)  # the spill holds one sample at a time
    assert peaks["workers_kib"] >> 10 < 256, peaks  # a writer holds one sample, one frame
    assert sum(s.num_samples for s in shardprep.read_manifest(str(out)).shards) == count
    assert not [n for n in os.listdir(tmp_path) if n.startswith("shardprep-")]  # spill removed


def test_killed_build_resumes_from_the_same_samples(
    built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--resume consumes the iterable again: the same samples finish the build byte for byte;
    other samples are refused by the journal's fingerprint."""
    out = tmp_path / "out"
    options = {"shards": SHARDS, "workers": 2}
    per_shard = COUNT // SHARDS
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.iterable_samples", "stall", str(out),
         str(COUNT), str(per_shard + per_shard // 2), json.dumps(options)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            names = os.listdir(out) if out.exists() else []
            finished = [n for n in names if n.startswith("shard-") and n.endswith(".tar")]
            partial = [n for n in names if n.endswith(".partial")]
            if len(finished) == 2 and len(partial) == 2:
                break  # both workers are stuck in their second shard
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the build never stalled"
            time.sleep(0.01)  # polling interval only
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stderr:
            proc.stderr.close()
    assert JOURNAL_NAME in os.listdir(out) and not (out / "manifest.json").exists()
    killed = [n for n in os.listdir(tmp_path) if n.startswith("shardprep-build-")]
    assert len(killed) == 2  # the spill's folder and the build's: left by the SIGKILL
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the builds here sweep them

    def other() -> Iterator[dict[str, Any]]:
        for s in samples(COUNT):
            yield s | {"txt": "other"} if s["__key__"] == "s00500" else s

    before = _hashes(out)
    with pytest.raises(InputError, match="used other input or options"):
        shardprep.build(other(), str(out), resume=True, progress=False, **options)
    assert _hashes(out) == before
    summary = shardprep.build(samples(COUNT), str(out), resume=True, progress=False, **options)
    assert summary.reused_shards == 2
    assert _hashes(out) == _hashes(built)
    # the killed build's spill was swept by the next build, the resumed builds left none
    assert not [n for n in os.listdir(tmp_path) if n.startswith("shardprep-")]


def test_scratch_is_private_and_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    seen: list[list[str]] = []

    def watched() -> Iterator[dict[str, Any]]:
        for i, s in enumerate(samples(20)):
            if i == 10:  # mid-spill: one locked build folder holds the spill
                seen.append(sorted(os.listdir(scratch)))
            yield s

    shardprep.build(watched(), str(tmp_path / "out"), shards=2, workers=1, progress=False)
    assert len(seen[0]) == 1 and seen[0][0].startswith("shardprep-build-")
    assert os.listdir(scratch) == []


def test_ray_engine_on_this_machine_gives_the_local_tree(
    built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--engine ray without a cluster address reads the spill from this machine's disk; a
    spill of several tar files is scanned by several tasks."""
    pytest.importorskip("ray")
    import shardprep.scan.iterable as spill

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(spill, "FILE_SAMPLES", 64)  # 16 spill files, 16 scan tasks
    on_ray, local = tmp_path / "ray", tmp_path / "local"
    options: dict[str, Any] = {"shards": SHARDS, "workers": 2, "progress": False}
    shardprep.build(samples(COUNT), str(on_ray), engine="ray", **options)
    shardprep.build(samples(COUNT), str(local), **options)
    assert _hashes(on_ray) == _hashes(local)
    assert _shard_tars(on_ray) == _shard_tars(built)  # the split shows only in the sources
    files = set()
    for index in on_ray.glob("shard-*.idx"):
        decoded = decode_index(index.read_bytes(), str(index))
        blob, ends = bytes(decoded.source_blob), decoded.source_end.tolist()
        files |= {
            blob[a:b].decode().split(":")[0] for a, b in zip([0, *ends[:-1]], ends, strict=True)
        }
    assert files == {f"iterable-{n:05d}.tar" for n in range(16)}


@pytest.mark.filterwarnings(  # Ray Data's own deprecated DataContext fields; not ours
    "ignore::DeprecationWarning:ray.*"
)
def test_ray_dataset_rows_give_the_generator_tree(tmp_path: Path) -> None:
    """What docs/pipeline.md shows: a Ray Dataset fed through ``iter_rows()`` (in order)."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    count = 200
    rows = [sample(i) | {"json": json.dumps(sample(i)["json"])} for i in range(count)]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        context = ray.data.DataContext.get_current()
        context.execution_options.preserve_order = True
        dataset = ray.data.from_items(rows).map(lambda row: row | {"txt": row["txt"].upper()})
        out = tmp_path / "ray"
        shardprep.build(dataset.iter_rows(), str(out), shards=3, workers=2, progress=False)
    finally:
        ray.shutdown()
    expected = tmp_path / "gen"
    upper = (r | {"txt": r["txt"].upper()} for r in rows)
    shardprep.build(upper, str(expected), shards=3, workers=2, progress=False)
    assert _hashes(out) == _hashes(expected)
