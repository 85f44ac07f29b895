"""A tiny Qwen2-VL with its tokenizer, image processor and squares data, built once per session."""

import pytest

from tidal.tasks.squares import SquaresSpec, build_squares_assets


@pytest.fixture(scope="session")
def squares_assets(tmp_path_factory):
    return build_squares_assets(SquaresSpec(workdir=str(tmp_path_factory.mktemp("squares"))))
