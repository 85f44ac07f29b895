"""The README's config table lists exactly the config keys that exist (no stale or missing flags)."""

from pathlib import Path

from tidal.config import config_reference_markdown

README = Path(__file__).resolve().parents[2] / "README.md"
START, END = "<!-- config-table -->", "<!-- /config-table -->"


def readme_table() -> str:
    text = README.read_text()
    return text[text.index(START) + len(START) : text.index(END)].strip()


def test_readme_config_table_is_current():
    assert readme_table() == config_reference_markdown(), (
        "README config table is stale: regenerate with `python tests/unit/test_core_readme.py`"
    )


if __name__ == "__main__":
    text = README.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{START}\n{config_reference_markdown()}\n{END}{tail}")
