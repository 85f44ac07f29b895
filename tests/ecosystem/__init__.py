"""Tests of the optional ecosystem extras (marker ``extras``). Each module imports its library with
:func:`import_extra`: where the library is absent it is skipped with the reason (the main CI run),
and with ``TIDAL_EXTRAS=required`` (the extras venvs of .ci/run) a missing library is an error, so
no test of these files can silently not run there."""

import importlib
import os

import pytest


def import_extra(module: str, extra: str):
    if os.environ.get("TIDAL_EXTRAS") == "required":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is not installed (pip install -e '.[{extra}]'): .ci/run runs these tests in "
                                              "its extras venvs")
