"""Every ```python block of README.md and docs/*.md is a test item (``python -m pytest docs README.md``).

Sybil runs them, not pytest-markdown-docs: each page has one namespace, so its blocks build on
each other top to bottom like a reader's session; pytest fixtures are injected by name; a block
that truly needs a server or a GPU is skipped by a directive in the page's source that states
why (``<!-- skip: next "needs an S3 bucket" -->``, an HTML comment GitHub does not show); it is
maintained and used by many projects. Item ids name the page: ``docs/loader.md::line:7,column:1``.

Each page runs in a fresh folder of its own, holding the paths its blocks use (``OUT``, ``RAW``,
``export/``, ...: small real builds made once per session), with the names it leaves to the reader
(``samples()``, ``model``, ...) in its namespace: tests/docs_fixtures.py. A block whose first line
is ``# NAME.py`` is also saved as that file in the page's folder, as the page tells the reader.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
import unittest
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sybil import Document, Example, Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser
from sybil.typing import Evaluator

# Containers often set PYTHONDONTWRITEBYTECODE=1 (this machine's image does). Then every
# process of the suite that imports shardprep or loader compiled them from source (the CLI and
# torchrun children, DataLoader workers started by spawn or a forkserver, Ray workers: about
# 2,000 processes in all), and each pytest worker rewrote the asserts of ~130 test modules
# again. The pytest processes write the caches (__pycache__/, ignored by git), so that every
# later process reads them; the children keep the environment they were given. On 2 cores this
# took 15 s off the suite (611 -> 596 s under -n 3, 2026-11-29).
sys.dont_write_bytecode = False

ROOT = Path(__file__).parent
PAGE_FIXTURE = "doc_page"  # the names a page's setup gives, merged into its namespace once
SAVED_AS = re.compile(r"# (\w+\.py)\n")  # a block that is a module the page tells you to save


class ReaderSession(Document):
    """A page whose blocks run in order in one namespace, even when xdist splits its items.

    Before a block runs, every earlier block of the page that has not run in this process runs
    first (``pytest -n 2`` without ``--dist loadfile`` may send a page's items to two workers).
    """

    def __init__(self, text: str, path: str) -> None:
        super().__init__(text, path)
        self.ran: set[int] = set()  # start offsets of the blocks run in this process
        self.names_given = False

    def evaluate(self, example: Example, evaluator: Evaluator) -> None:
        __tracebackhide__ = True
        for earlier in self.examples():
            if earlier.start >= example.start:
                break
            if earlier.start not in self.ran:
                self.replay(earlier)
        self.ran.add(example.start)
        names = self.namespace.pop(PAGE_FIXTURE, None)
        if names is not None and not self.names_given:
            self.namespace.update(names)
            self.names_given = True
        source = str(example.parsed)
        saved = SAVED_AS.match(source)
        if saved:
            Path(saved.group(1)).write_text(source)
        try:
            super().evaluate(example, evaluator)
        except unittest.SkipTest as skip:  # a skip directive: report it at the page's line
            raise pytest.skip.Exception(str(skip), _use_item_location=True) from None

    def replay(self, earlier: Example) -> None:
        try:
            earlier.evaluate()
        except (unittest.SkipTest, pytest.skip.Exception):
            pass  # a skipped block: skipped here too
        except Exception as error:
            raise RuntimeError(
                f"{self.path}, line {earlier.line}: this earlier block of the page failed when"
                " run first in this process, so the blocks after it cannot run"
            ) from error


pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["README.md", "docs/*.md"],
    excludes=["docs/contributing.md"],  # it shows the directives themselves, as examples
    fixtures=[PAGE_FIXTURE],
    document_types={".md": ReaderSession},
).pytest()


@pytest.fixture(scope="session")
def doc_data(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.docs_fixtures import DocData

    return DocData(tmp_path_factory.mktemp("docs-data"))


@pytest.fixture(scope="module")
def doc_page(
    request: pytest.FixtureRequest, doc_data: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The page's own folder (current directory, first on sys.path) and the names it needs."""
    import fsspec.config

    from tests.docs_fixtures import FORKSERVER_PRELOAD, PAGES
    from tests.processes import preloaded_forkserver

    page = Path(request.path).relative_to(ROOT).as_posix()
    folder = tmp_path_factory.mktemp(page.replace("/", "-").replace(".", "-"))
    setup = PAGES.get(page)
    before = os.getcwd()
    modules = set(sys.modules)
    fsspec_conf = {key: dict(value) for key, value in fsspec.config.conf.items()}
    os.chdir(folder)
    sys.path.insert(0, str(folder))
    try:
        with contextlib.ExitStack() as stack:
            if page in FORKSERVER_PRELOAD:  # as in the page's own process (docs_fixtures.py)
                stack.enter_context(preloaded_forkserver(FORKSERVER_PRELOAD[page]))
            yield setup(folder, doc_data) if setup else {}
    finally:
        os.chdir(before)
        sys.path.remove(str(folder))
        for name in set(sys.modules) - modules:  # modules the page saved and imported
            if getattr(sys.modules[name], "__file__", None) and Path(
                sys.modules[name].__file__ or ""
            ).is_relative_to(folder):
                del sys.modules[name]
        fsspec.config.conf.clear()  # a block may set fsspec defaults for this process
        fsspec.config.conf.update(fsspec_conf)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with multi-process jobs first; the doc pages' CPU warning ignored.

    Under ``pytest -n 3 --dist loadfile`` each file runs whole on one worker, handed out in
    collection order: a file of torchrun/Lightning/Ray jobs (marked ``slow`` or
    ``distributed``) that came last would run alone at the end while the other workers idle,
    so those files go first (longest-first scheduling); the order within a file is kept.
    The pages are written for GPU machines: on CPU, torch warns about pin_memory=True.
    """
    heavy = {
        i.path for i in items if i.get_closest_marker("slow") or i.get_closest_marker("distributed")
    }
    first_seen: dict[Path, int] = {}
    for index, item in enumerate(items):
        first_seen.setdefault(item.path, index)
    items.sort(key=lambda i: (i.path not in heavy, first_seen[i.path]))
    for item in items:
        if item.path.suffix == ".md":
            item.add_marker(
                pytest.mark.filterwarnings(
                    "ignore:'pin_memory' argument is set as true but no accelerator:UserWarning"
                )
            )


def pytest_unconfigure(config: pytest.Config) -> None:
    """Let each pytest process exit without collecting its garbage one last time.

    A pytest worker ends holding more than half a million objects (torch, Ray, Lightning,
    pyarrow, moto, hypothesis, the test results), and CPython's finalization walks them all in
    a last cyclic collection: seconds per worker, on every core, after the last test (the
    pages of docs/ under -n 3: 3.2 s from the last test to the end of pytest, 0.9 s frozen).
    Frozen objects are skipped by that walk; the memory goes back to the system at exit.
    """
    gc.freeze()
