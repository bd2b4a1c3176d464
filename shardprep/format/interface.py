"""How a message names an option of the build: the CLI's flag or the Python API's keyword.

A message that tells the user what to pass names the option the way the user gives it: a
build started by ``shardprep build`` says ``--shards`` and "run the same command with
--resume"; one started by ``shardprep.build(...)`` says ``shards=`` and "call shardprep.build
again with resume=True". Messages are written once, with :meth:`Interface.option`,
:meth:`Interface.setting`, :meth:`Interface.again` and :meth:`Interface.without`; the build's
:class:`~shardprep.config.BuildConfig` carries the interface (``PYTHON`` unless the CLI
passes ``CLI``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["CLI", "PYTHON", "Interface"]

# BuildConfig fields whose CLI flag is not the field name with '-' for '_'
_FLAGS = {
    "compression": "--compress",
    "input_format": "--format",
    "storage_options": "--storage-option",
    "raw_storage_options": "--raw-storage-option",
    "out_storage_options": "--out-storage-option",
}


@dataclass(frozen=True)
class Interface:
    """``cli``: True for ``shardprep build``, False for ``shardprep.build(...)``."""

    cli: bool

    def option(self, field: str) -> str:
        """How the user names option ``field``: ``--shards`` or ``shards=``."""
        if self.cli:
            return _FLAGS.get(field, "--" + field.replace("_", "-"))
        return f"{field}="

    def setting(self, field: str, value: object = True) -> str:
        """Option ``field`` given ``value``: ``--resume``, ``--workers 1``; ``resume=True``,
        ``workers=1``. A dict (storage options) is one ``--storage-option 'KEY=JSON'`` a key
        on the CLI."""
        if not self.cli:
            return f"{field}={value!r}"
        flag = self.option(field)
        if value is True:
            return flag
        if isinstance(value, dict):
            return " ".join(f"{flag} '{key}={json.dumps(item)}'" for key, item in value.items())
        return f"{flag} {value}"

    def again(self, field: str | None = None, instead: str | None = None) -> str:
        """How to run this build again, with option ``field`` set (a flag: True) in place of
        option ``instead``: "run the same command with --resume instead of --overwrite"."""
        if self.cli:
            if field is None:
                return "run the same command again"
            swap = f" instead of {self.setting(instead)}" if instead else ""
            return f"run the same command with {self.setting(field)}{swap}"
        if field is None:
            return "call shardprep.build again with the same arguments"
        swap = f" (not {self.setting(instead)})" if instead else ""
        return f"call shardprep.build again with the same arguments and {self.setting(field)}{swap}"

    def without(self, field: str) -> str:
        """How to run this build again without option ``field``: "run without --resume",
        "call shardprep.build without resume=True"."""
        if self.cli:
            return f"run without {self.setting(field)}"
        return f"call shardprep.build without {self.setting(field)}"


CLI = Interface(cli=True)
PYTHON = Interface(cli=False)
