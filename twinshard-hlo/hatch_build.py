"""Put the checkout's twinshard/hlo/ and twinshard/testing.py into this distribution's wheel
and sdist at the same import paths (`twinshard.hlo`, `twinshard.testing`).

From the checkout they are one directory up; from an unpacked sdist they sit beside this file.
An editable install copies nothing: `dev-mode-dirs` puts the checkout on sys.path instead.
"""

from __future__ import annotations

import pathlib

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

FILES = ("twinshard/hlo", "twinshard/testing.py")


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        if version == "editable":
            return
        here = pathlib.Path(self.root)
        base = here.parent if (here.parent / FILES[0]).is_dir() else here
        for path in FILES:
            build_data["force_include"][str(base / path)] = path
