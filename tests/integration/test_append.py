"""Issue 37 items 4-6: ``build NEW OUT --shards K --append`` writes version N+1 of OUT.

Every check is exact: file bytes before and after, class indices read back from the shards'
indexes, per-shard and per-class counts, a second OUT built the same way byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import shardprep
import shardprep.append
from shardprep.builder import interrupted_around
from shardprep.format.errors import InputError, ManifestError
from shardprep.format.manifest import JOURNAL_NAME, read_manifest
from shardprep.format.shardformat import decode_index
from shardprep.format.versions import manifest_version, read_version, version_file
from shardprep.out_lock import LOCK_WAIT_S
from shardprep.verify import verify_output
from tests.conftest import payload
from tests.processes import run_bounded
from tests.stalled_build import kill_stalled_build

ROOT = Path(__file__).resolve().parents[2]
BASE = {"dog": 40, "zebra": 21}  # classes 0 and 1 of the build
NEW = {"cat": 11, "dog": 9}  # cat is new (index 2); dog keeps index 0 (NEW alone: 1)


def make_raw(root: Path, counts: dict[str, int], first: int) -> Path:
    """``root/<class>/<index:05d>.bin`` (indices from ``first``, so keys differ by ``first``)."""
    index = first
    for label, (name, count) in enumerate(sorted(counts.items())):
        (root / name).mkdir(parents=True)
        for _ in range(count):
            (root / name / f"{index:05d}.bin").write_bytes(payload(label, index) * 3)
            index += 1
    return root


def tree(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` (hidden ones and versions/ included), by path."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def labels_by_key(out: Path, shard: int) -> dict[str, int]:
    index = decode_index((out / f"shard-{shard:05d}.idx").read_bytes())
    return {index.key(i): int(index.label[i]) for i in range(index.num_samples)}


@pytest.fixture
def raws(tmp_path: Path) -> tuple[Path, Path]:
    return make_raw(tmp_path / "base", BASE, 0), make_raw(tmp_path / "new", NEW, 1000)


def build_then_append(base: Path, new: Path, out: Path, **options: Any) -> Any:
    shardprep.build(str(base), str(out), shards=4, workers=1, progress=False)
    return shardprep.build(
        str(new), str(out), shards=3, append=True, progress=False, **{"workers": 2, **options}
    )


def test_append_is_the_next_version(raws: tuple[Path, Path], tmp_path: Path) -> None:
    base, new = raws
    out = tmp_path / "out"
    shardprep.build(str(base), str(out), shards=4, workers=1, progress=False)
    before = tree(out)
    version1 = (out / "manifest.json").read_bytes()
    summary = shardprep.build(str(new), str(out), shards=3, append=True, workers=2, progress=False)
    assert (summary.version, summary.first_shard, summary.num_shards) == (2, 4, 3)
    assert summary.num_samples == 20 and (summary.min_shard_samples, summary.max_shard_samples) == (
        6,
        7,
    )
    after = tree(out)
    # earlier shards never rewritten; exactly three shards and two version files added
    assert {k: after[k] for k in before if k != "manifest.json"} == {
        k: v for k, v in before.items() if k != "manifest.json"
    }
    added = sorted(set(after) - set(before))
    assert added == [
        *(f"shard-{s:05d}.{e}" for s in (4, 5, 6) for e in ("idx", "tar")),
        version_file(1),
        version_file(2),
    ]
    assert (out / version_file(1)).read_bytes() == version1
    assert (out / version_file(2)).read_bytes() == (out / "manifest.json").read_bytes()
    manifest = read_manifest(str(out))
    assert manifest_version(manifest) == 2
    assert manifest.class_names == ("dog", "zebra", "cat")  # old indices kept, cat appended
    assert manifest.class_counts == (49, 21, 11)
    new_shards = manifest.shards[4:]
    assert sorted(s.num_samples for s in new_shards) == [6, 7, 7]
    for c in range(3):  # class-stratified among themselves: +-1
        counts = [s.class_counts[c] for s in new_shards]
        assert max(counts) - min(counts) <= 1, (c, counts)
    assert [s.class_counts[1] for s in new_shards] == [0, 0, 0]
    assert all(s.class_counts[2] == 0 for s in manifest.shards[:4])  # padded, not changed
    # the labels in the new shards are the build's indices (dog 0, cat 2), never NEW's alone
    keys = {k: v for s in (4, 5, 6) for k, v in labels_by_key(out, s).items()}
    expected = {f"cat__{i:05d}": 2 for i in range(1000, 1011)}
    expected |= {f"dog__{i:05d}": 0 for i in range(1011, 1020)}
    assert keys == expected
    # bytes even among the new shards: within one sample per class of each other
    largest = max(len(payload(0, i) * 3) for i in range(1000, 1020)) + 3 * 512
    sizes = [s.num_bytes for s in new_shards]
    assert max(sizes) - min(sizes) <= 2 * largest
    assert verify_output(str(out)).problems == []
    # the versions section says what each version added
    entries = manifest.extra["versions"]
    assert [
        (e["version"], e["first_shard"], e["num_shards"], e["num_samples"]) for e in entries
    ] == [
        (1, 0, 4, 61),
        (2, 4, 3, 20),
    ]
    assert entries[0]["manifest_sha256"] == hashlib.sha256(version1).hexdigest()
    assert read_version(
        manifest, 1, lambda n, k: (out / n).read_bytes()[:k], str(out)
    ).fingerprint == (hashlib.sha256(version1).hexdigest())


def test_append_is_byte_reproducible(raws: tuple[Path, Path], tmp_path: Path) -> None:
    base, new = raws
    build_then_append(base, new, tmp_path / "one", workers=2)
    build_then_append(base, new, tmp_path / "two", workers=1)
    assert tree(tmp_path / "one") == tree(tmp_path / "two")


def test_third_version_and_version_1_of_an_old_build(
    raws: tuple[Path, Path], tmp_path: Path
) -> None:
    """A plain build's manifest has no versions section (as every build before versions):
    it is version 1; a second append records both earlier manifests' sha256."""
    base, new = raws
    out = tmp_path / "out"
    shardprep.build(str(base), str(out), shards=4, workers=1, progress=False)
    plain = json.loads((out / "manifest.json").read_bytes())
    assert "versions" not in plain and manifest_version(read_manifest(str(out))) == 1
    shardprep.build(str(new), str(out), shards=3, append=True, workers=1, progress=False)
    third = make_raw(tmp_path / "third", {"emu": 5}, 2000)
    summary = shardprep.build(str(third), str(out), shards=2, append=True, progress=False)
    assert (summary.version, summary.first_shard) == (3, 7)
    manifest = read_manifest(str(out))
    assert manifest.class_names == ("dog", "zebra", "cat", "emu")
    assert sorted(s.num_samples for s in manifest.shards[7:]) == [2, 3]
    v2 = (out / version_file(2)).read_bytes()
    assert manifest.extra["versions"][1]["manifest_sha256"] == hashlib.sha256(v2).hexdigest()
    assert (out / version_file(3)).read_bytes() == (out / "manifest.json").read_bytes()
    read = lambda name, limit: (out / name).read_bytes()[:limit]  # noqa: E731
    assert read_version(manifest, 2, read, str(out)).num_samples == 81
    assert read_version(manifest, 1, read, str(out)).num_samples == 61
    assert verify_output(str(out)).problems == []


def test_repeated_key_refused_nothing_written(raws: tuple[Path, Path], tmp_path: Path) -> None:
    base, new = raws
    out = tmp_path / "out"
    shardprep.build(str(base), str(out), shards=4, workers=1, progress=False)
    (new / "dog" / "00007.bin").write_bytes(b"a sample whose key the build holds")
    before = tree(out)
    with pytest.raises(InputError) as caught:
        shardprep.build(str(new), str(out), shards=3, append=True, progress=False)
    message = str(caught.value)
    shard = next(s for s in range(4) if "dog__00007" in labels_by_key(out, s))
    assert "'dog__00007' is already in" in message
    assert f"shard-{shard:05d}.tar (version 1 of the build)" in message
    assert message.startswith(f"{new}/dog/00007.bin: ") and "Nothing was written" in message
    assert tree(out) == before
    assert sorted(os.listdir(out)) == sorted(before)  # no journal, no versions folder


def test_append_refusals(raws: tuple[Path, Path], tmp_path: Path) -> None:
    base, new = raws
    out = tmp_path / "out"
    with pytest.raises(InputError, match="holds no build to append to"):
        shardprep.build(str(new), str(out), shards=3, append=True, progress=False)
    assert not out.exists()
    shardprep.build(str(base), str(out), shards=4, workers=1, progress=False)
    with pytest.raises(InputError, match="compressed 'none', not 'zstd'.*compression='none'"):
        shardprep.build(
            str(new), str(out), shards=3, append=True, compression="zstd", progress=False
        )
    unlabelled = tmp_path / "flat"
    unlabelled.mkdir()
    (unlabelled / "x.bin").write_bytes(b"1")
    (unlabelled / "y.bin").write_bytes(b"2")
    with pytest.raises(InputError, match="is labelled and .* is not"):
        shardprep.build(str(unlabelled), str(out), shards=1, append=True, progress=False)
    numbered = make_raw(tmp_path / "numbered", {"0": 2, "1": 2}, 3000)
    with pytest.raises(InputError, match="integer labels .* and .* class names"):
        shardprep.build(str(numbered), str(out), shards=1, append=True, progress=False)
    with pytest.raises(InputError, match="no interrupted append to resume"):
        shardprep.build(str(new), str(out), shards=3, append=True, resume=True, progress=False)
    assert "versions" not in os.listdir(out)


def test_class_weights_apply_per_version(raws: tuple[Path, Path], tmp_path: Path) -> None:
    """--class-weights of an append resample NEW's samples only, over the build's classes
    (a class NEW lacks gets weight 0); each version keeps its own class_weighting."""
    base, new = raws
    out = tmp_path / "out"
    shardprep.build(str(base), str(out), shards=4, class_weights="balanced", progress=False)
    v1 = read_manifest(str(out)).extra["class_weighting"]
    shardprep.build(
        str(new), str(out), shards=2, append=True, class_weights="balanced", progress=False
    )
    manifest = read_manifest(str(out))
    assert "class_weighting" not in manifest.extra  # per version, not over the union
    entries = manifest.extra["versions"]
    assert entries[0]["class_weighting"] == v1
    weighting = entries[1]["class_weighting"]
    assert weighting["original_counts"] == [9, 0, 11]  # dog, zebra, cat of NEW
    assert weighting["realized_counts"] == [10, 0, 10]
    assert [sum(s.class_counts[c] for s in manifest.shards[4:]) for c in range(3)] == [10, 0, 10]
    assert [sum(s.class_counts[c] for s in manifest.shards[:4]) for c in range(3)] == [31, 30, 0]


def test_kill_9_mid_append_then_resume(raws: tuple[Path, Path], tmp_path: Path) -> None:
    base, new = raws
    reference = tmp_path / "reference"
    build_then_append(base, new, reference)
    out = tmp_path / "out"
    shardprep.build(str(base), str(out), shards=4, workers=1, progress=False)
    version1 = (out / "manifest.json").read_bytes()
    kill_stalled_build(
        new,
        out,
        8,  # the first new shard (7 samples) is finished, the second is being written
        {"shards": 3, "append": True, "workers": 1},
        lambda: (out / "shard-00004.tar").exists() and (out / JOURNAL_NAME).exists(),
        tmp_path,
    )
    assert (out / "manifest.json").read_bytes() == version1  # readers still see version 1
    assert not (out / "shard-00005.tar").exists()
    from loader import ShardDataset

    reading = _keys(ShardDataset(str(out), rank=0, world_size=1))
    assert len(reading) == 61 and all(int(k[-5:]) < 1000 for k in reading)
    assert verify_output(str(out)).problems == []
    assert interrupted_around(str(out), True, False, 3, "none", append=True) == (
        f"interrupted; the 1 finished shard(s) are kept in {out}: run the same command with "
        "--resume to finish the build"
    )
    with pytest.raises(
        InputError, match="a build or append into it is in progress, or was interrupted"
    ):
        shardprep.build(str(new), str(out), shards=3, append=True, progress=False)
    with pytest.raises(InputError, match="an append: resume it with append=True"):
        shardprep.build(str(base), str(out), shards=4, resume=True, progress=False)
    summary = shardprep.build(
        str(new), str(out), shards=3, append=True, resume=True, progress=False
    )
    assert (summary.version, summary.reused_shards) == (2, 1)
    assert tree(out) == tree(reference)
    again = shardprep.build(str(new), str(out), shards=3, append=True, resume=True, progress=False)
    assert again.already_complete and (again.version, again.first_shard) == (2, 4)
    assert tree(out) == tree(reference)


def test_killed_after_publishing_before_the_journal_went(
    raws: tuple[Path, Path], tmp_path: Path
) -> None:
    """Killed between manifest.json and the journal's removal: --resume finishes the append
    it already published (same bytes), not a third version."""
    base, new = raws
    reference = tmp_path / "reference"
    build_then_append(base, new, reference)
    out = tmp_path / "out"
    build_then_append(base, new, out)
    journal = {"input_fingerprint": read_manifest(str(out)).input_fingerprint}
    (out / JOURNAL_NAME).write_text(
        json.dumps(
            {
                **journal,
                "options": read_manifest(str(out)).options,
                "append": {
                    "base_version": 1,
                    "first_shard": 4,
                    "base_manifest_sha256": read_manifest(str(out)).extra["versions"][0][
                        "manifest_sha256"
                    ],
                },
            }
        )
    )
    summary = shardprep.build(
        str(new), str(out), shards=3, append=True, resume=True, progress=False
    )
    assert (summary.version, summary.reused_shards, summary.already_complete) == (2, 3, False)
    assert tree(out) == tree(reference)


def test_changed_version_file_refused(raws: tuple[Path, Path], tmp_path: Path) -> None:
    base, new = raws
    out = tmp_path / "out"
    build_then_append(base, new, out)
    path = out / version_file(1)
    path.write_bytes(path.read_bytes().replace(b'"seed": 0', b'"seed": 1'))
    manifest = read_manifest(str(out))
    with pytest.raises(ManifestError, match="not the manifest of version 1 that version 2 records"):
        read_version(manifest, 1, lambda n, k: (out / n).read_bytes()[:k], str(out))
    with pytest.raises(ManifestError, match="there is no version 3"):
        read_version(manifest, 3, lambda n, k: (out / n).read_bytes()[:k], str(out))
    assert any("versions/manifest-00001.json" in p for p in verify_output(str(out)).problems)


def test_append_onto_a_damaged_build_refused(raws: tuple[Path, Path], tmp_path: Path) -> None:
    base, new = raws
    out = tmp_path / "out"
    shardprep.build(str(base), str(out), shards=4, workers=1, progress=False)
    index = out / "shard-00002.idx"
    data = bytearray(index.read_bytes())
    data[-1] ^= 1
    index.write_bytes(bytes(data))
    before = tree(out)
    with pytest.raises(ManifestError, match="shard-00002.idx: not the index the manifest records"):
        shardprep.build(str(new), str(out), shards=3, append=True, progress=False)
    assert tree(out) == before


APPEND_CHILD = """
import sys, shardprep
shardprep.build(sys.argv[1], sys.argv[2], shards=2, append=True, progress=False)
"""


def test_concurrent_appends_never_both_publish(
    raws: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Append B (this process) holds OUT, paused after it read its base; append A (a real
    second process) is refused after LOCK_WAIT_S, naming this process; B then publishes
    version 2 alone."""
    base, new = raws
    out = tmp_path / "out"
    shardprep.build(str(base), str(out), shards=4, workers=1, progress=False)
    other = make_raw(tmp_path / "other", {"cat": 4}, 5000)
    seen: list[subprocess.CompletedProcess[str]] = []
    check = shardprep.append.check_new_keys

    def racing(*args: Any, **kwargs: Any) -> None:
        seen.append(
            run_bounded(
                [sys.executable, "-c", APPEND_CHILD, str(other), str(out)],
                LOCK_WAIT_S + 60,
                cwd=ROOT,
            )
        )
        check(*args, **kwargs)

    monkeypatch.setattr("shardprep.builder.check_new_keys", racing)
    summary = shardprep.build(str(new), str(out), shards=3, append=True, progress=False)
    (child,) = seen
    assert child.returncode == 1, child.stderr
    assert "another shardprep build is still writing into this folder" in child.stderr
    assert f"{os.getpid()} (" in child.stderr
    assert summary.version == 2
    manifest = read_manifest(str(out))
    assert manifest_version(manifest) == 2 and len(manifest.shards) == 7
    assert not (out / version_file(3)).exists() and not (out / "shard-00007.tar").exists()


def _keys(dataset: Any) -> list[str]:
    return [str(sample["__key__"]) for sample in dataset]


def test_loader_reads_each_version_exactly(raws: tuple[Path, Path], tmp_path: Path) -> None:
    """ShardDataset(OUT, version=1) is the build as it was before the append, sample for
    sample in the same order; no version (or the newest) is every sample; a resume state
    saved on version 1 resumes on version 1 only, refused by name on the newest."""
    from loader import ShardDataset
    from loader.core import ShardStream
    from loader.errors import IncompatibleStateError

    base, new = raws
    plain, out = tmp_path / "plain", tmp_path / "out"
    shardprep.build(str(base), str(plain), shards=4, workers=1, progress=False)
    build_then_append(base, new, out)
    one: dict[str, Any] = {"rank": 0, "world_size": 1, "seed": 3}
    before = _keys(ShardDataset(str(plain), **one))
    assert len(before) == 61
    assert _keys(ShardDataset(str(out), version=1, **one)) == before
    newest = _keys(ShardDataset(str(out), **one))
    assert len(newest) == 81 and set(before) < set(newest)
    assert _keys(ShardDataset(str(out), version=2, **one)) == newest
    stream = ShardStream(str(out), version=1)
    assert [s.num_samples for s in stream.manifest.shards] == [
        s.num_samples for s in read_manifest(str(plain)).shards
    ]
    with pytest.raises(ManifestError, match="there is no version 3: the build has versions 1 to 2"):
        ShardDataset(str(out), version=3, **one)
    batched: dict[str, Any] = {"rank": 0, "world_size": 1, "batch_size": 8}
    saved = ShardDataset(str(out), version=1, **batched)
    batches = iter(saved)
    next(batches)
    state = saved.state_after(next(batches))
    again = ShardDataset(str(out), version=1, **batched)
    again.resume(state)
    rest = [k for b in again for k in b["__key__"]]
    assert len(rest) == 61 - 16
    moved = ShardDataset(str(out), **batched)
    with pytest.raises(IncompatibleStateError, match="another version of it"):
        moved.resume(state)
        next(iter(moved))


def test_inspect_and_verify_show_versions(raws: tuple[Path, Path], tmp_path: Path) -> None:
    from tests.faults.helpers import invoke

    base, new = raws
    out = tmp_path / "out"
    build_then_append(base, new, out)
    sha1 = hashlib.sha256((out / version_file(1)).read_bytes()).hexdigest()
    text = invoke("inspect", str(out)).output.splitlines()
    assert text[3:6] == [
        "  versions: 2 (this manifest is version 2)",
        f"    1: shards 0-3, 61 samples, manifest sha256 {sha1}",
        "    2: shards 4-6, 20 samples (manifest.json)",
    ]
    data = json.loads(invoke("inspect", "--json", str(out)).output)
    assert data["version"] == 2 and [v["num_shards"] for v in data["versions"]] == [4, 3]
    result = invoke("verify", "-q", str(out))
    assert result.exit_code == 0
    assert result.output == (
        "ok: 7 shards, 81 samples verified (version 2; its earlier versions checked too)\n"
    )
    (out / version_file(1)).unlink()
    result = invoke("verify", "-q", str(out))
    assert result.exit_code == 1
    assert "versions/manifest-00001.json: " in result.stderr and "is missing" in result.stderr


def test_append_from_an_iterable(tmp_path: Path) -> None:
    """append=True takes samples from code too; a repeated key is named without the scratch
    file it was spilled to."""
    out = tmp_path / "out"
    first = [{"__key__": f"k{i}", "bin": bytes([i]) * 10, "cls": i % 2} for i in range(20)]
    shardprep.build(first, str(out), shards=2, progress=False)
    more = [{"__key__": f"n{i}", "bin": bytes([i]) * 10, "cls": i % 3} for i in range(9)]
    summary = shardprep.build(more, str(out), shards=2, append=True, progress=False)
    assert (summary.version, summary.first_shard, summary.num_samples) == (2, 2, 9)
    assert read_manifest(str(out)).class_counts == (13, 13, 3)
    before = tree(out)
    again = [{"__key__": "k3", "bin": b"x", "cls": 0}]
    with pytest.raises(InputError) as caught:
        shardprep.build(again, str(out), shards=1, append=True, progress=False)
    assert str(caught.value) == (
        f"sample key 'k3' is already in {out}/shard-00001.tar (version 1 of the build); keys are "
        "unique across every version of a build: give the sample another __key__ or leave it "
        "out (nothing was written to OUT)"
    )
    assert tree(out) == before


def test_overwrite_of_a_versioned_build_removes_its_versions(
    raws: tuple[Path, Path], tmp_path: Path
) -> None:
    """--overwrite replaces every version: a later append must not find version files of the
    build it replaced (it would record a stale version 1)."""
    base, new = raws
    out, reference = tmp_path / "out", tmp_path / "reference"
    build_then_append(base, new, out)
    (out / "versions" / "notes.txt").write_text("not a build's file")
    shardprep.build(str(new), str(out), shards=2, overwrite=True, progress=False)
    assert sorted(os.listdir(out / "versions")) == ["notes.txt"]  # a file not ours stays
    (out / "versions" / "notes.txt").unlink()
    shardprep.build(str(new), str(reference), shards=2, progress=False)
    assert tree(out) == tree(reference)
    assert manifest_version(read_manifest(str(out))) == 1


def test_disk_full_mid_append_then_resume(raws: tuple[Path, Path], tmp_path: Path) -> None:
    """A full disk stops an append with one error counting the append's own finished shards;
    OUT stays version 1 (readable); with room again, --resume finishes it byte-identical."""
    from shardprep.format.errors import WriteError
    from tests.filesystems import tmpfs

    base, new = raws
    reference = tmp_path / "reference"
    build_then_append(base, new, reference, workers=1)
    with tmpfs(tmp_path / "disk", "size=1m") as disk:
        out = disk / "out"
        shardprep.build(str(base), str(out), shards=4, workers=1, progress=False)
        version1 = (out / "manifest.json").read_bytes()
        first_new = (reference / "shard-00004.tar").stat().st_size
        room = os.statvfs(disk)
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (room.f_bavail * room.f_frsize - first_new - 12 * 1024))
        with pytest.raises(WriteError) as caught:
            shardprep.build(str(new), str(out), shards=3, append=True, workers=1, progress=False)
        message = str(caught.value)
        assert "no space left on the device" in message
        kept = len([s for s in (4, 5, 6) if (out / f"shard-{s:05d}.tar").exists()])
        assert kept == 1 and message.endswith(
            "the 1 finished shard(s) are kept: fix the cause, then call shardprep.build again "
            "with the same arguments and resume=True"
        )
        assert (out / "manifest.json").read_bytes() == version1
        assert not (out / "versions").exists()
        filler.unlink()
        summary = shardprep.build(
            str(new), str(out), shards=3, append=True, resume=True, workers=1, progress=False
        )
        assert (summary.version, summary.reused_shards) == (2, 1)
        assert tree(out) == tree(reference)


def _spark_export(folder: Path, first_id: int, with_id: bool) -> Path:
    """A Spark-shaped export of 10 rows: part-00000-<uuid>-c000.snappy.parquet (+ _SUCCESS)."""
    import uuid

    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    columns: dict[str, Any] = {
        "bin": [payload(i % 2, first_id + i) for i in range(10)],
        "label": [i % 2 for i in range(10)],
    }
    if with_id:
        columns["id"] = list(range(first_id, first_id + 10))
    pq.write_table(pa.table(columns), folder / f"part-00000-{uuid.uuid4()}-c000.snappy.parquet")
    (folder / "_SUCCESS").write_bytes(b"")
    return folder


def test_parquet_exports_appended_day_by_day(tmp_path: Path) -> None:
    """Spark names every day's file part-00000-...: without a key column day 2's rows get day
    1's keys, and the append is refused naming RAW and what to do; with an id column unique
    across days, day 2 appends."""
    out = tmp_path / "out"
    shardprep.build(str(_spark_export(tmp_path / "day1", 0, False)), str(out), shards=2,
                    progress=False)  # fmt: skip
    day2 = _spark_export(tmp_path / "day2", 10, False)
    before = tree(out)
    with pytest.raises(InputError) as caught:
        shardprep.build(str(day2), str(out), shards=1, append=True, progress=False)
    assert str(caught.value).startswith(f"{day2}: its sample key 'part-00000-c000_snappy-000000")
    assert "key_column= naming a column unique across them" in str(caught.value)
    assert tree(out) == before
    keyed = tmp_path / "keyed"
    shardprep.build(str(_spark_export(tmp_path / "k1", 0, True)), str(keyed), shards=2,
                    progress=False)  # fmt: skip
    summary = shardprep.build(
        str(_spark_export(tmp_path / "k2", 10, True)), str(keyed), shards=1, append=True,
        progress=False,
    )  # fmt: skip
    assert (summary.version, summary.num_samples) == (2, 10)
    assert verify_output(str(keyed)).problems == []
    keys = {k for s in range(3) for k in labels_by_key(keyed, s)}
    assert len(keys) == 20


def test_ctrl_c_around_a_finished_append_says_the_version(
    raws: tuple[Path, Path], tmp_path: Path
) -> None:
    base, new = raws
    out = tmp_path / "out"
    build_then_append(base, new, out)
    assert interrupted_around(str(out), True, False, 3, "none", append=True) == (
        f"interrupted as the append began or returned: {out} is complete at version 2 "
        f"(shardprep inspect {out} lists its versions)"
    )
    (out / "manifest.json").write_text("{")
    assert interrupted_around(str(out), True, False, 3, "none", append=True) == (
        f"interrupted as the append began or returned: {out} is complete (shardprep inspect "
        f"{out} lists its versions)"
    )


def test_cli_append(raws: tuple[Path, Path], tmp_path: Path) -> None:
    from tests.faults.helpers import invoke

    base, new = raws
    out = tmp_path / "out"
    assert invoke("build", str(base), str(out), "-n", "4", "-q").exit_code == 0
    result = invoke("build", str(new), str(out), "-n", "3", "--append", "-j", "1")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == f"wrote 3 shards to {out} (version 2: shards 4-6)"
    result = invoke("build", str(new), str(out), "-n", "3", "--append", "--resume", "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert (data["version"], data["first_shard"], data["num_samples"]) == (2, 4, 20)
    assert data["already_complete"] is True
    assert f"{out}: the append (version 2) is already complete; nothing to resume" in result.stderr
    refused = invoke("build", str(new), str(out), "-n", "3", "--append", "--overwrite")
    assert (
        refused.exit_code == 2 and "--overwrite and --append exclude each other" in refused.stderr
    )


def test_an_unreadable_journal_is_named(raws: tuple[Path, Path], tmp_path: Path) -> None:
    base, new = raws
    out = tmp_path / "out"
    shardprep.build(str(base), str(out), shards=4, workers=1, progress=False)
    (out / JOURNAL_NAME).write_bytes(b"\xff not json")
    with pytest.raises(InputError) as caught:
        shardprep.build(str(new), str(out), shards=3, append=True, resume=True, progress=False)
    assert str(caught.value) == (
        f"{out}/{JOURNAL_NAME}: the build journal is unreadable; start over with overwrite=True"
    )
