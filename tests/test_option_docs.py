"""The README's flag lists are the option tables (runtime/option_fields.py's flag_list of RunOptions and
ExportRequest): a flag added, renamed or given another value in a table and not in the README fails here."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def listed_flags(opening: str) -> list[str]:
    """The `--flag VALUE` items of the README paragraph that starts with opening, in order (a line break inside an
    item reads as the space Markdown renders)."""
    text = README.read_text()
    start = text.index(opening)
    listing = re.search(r"\): (.*?)[.;](\s|$)", text[start:], re.S).group(1)  # up to the sentence's end
    return [" ".join(m.split()) for m in re.findall(r"`([^`]+)`", listing, re.S)]


@pytest.mark.parametrize("opening, table", [("Run options (", "RunOptions"), ("Export options (", "ExportRequest")])
def test_the_readme_lists_every_flag_of_the_table(opening, table):
    from staticlm.export.options import ExportRequest
    from staticlm.runtime.option_fields import flag_list
    from staticlm.runtime.options import RunOptions

    owner = {"RunOptions": RunOptions, "ExportRequest": ExportRequest}[table]
    assert listed_flags(opening) == flag_list(owner)


def test_the_help_shows_each_flag_as_the_readme_does():
    """--help and the README come from one declaration: each `--flag VALUE` of the lists is a line of --help."""
    from staticlm.apps.cli import build_parser

    for command, opening in (("generate", "Run options ("), ("export", "Export options (")):
        parser = build_parser(command)
        sub = next(a for a in parser._actions if a.dest == "command").choices[command]
        usage = " ".join(sub.format_help().split())
        for item in listed_flags(opening):
            assert item in usage, (command, item)


def test_a_typed_number_is_checked_by_the_table_in_one_line():
    """The flags hand the table text; the table's check names the flag (no argparse usage dump)."""
    from staticlm.apps.cli import build_parser, typed_run_options
    from staticlm.errors import InvalidOption
    from staticlm.runtime.options import RunOptions

    typed = typed_run_options(build_parser("generate").parse_args(["generate", "--prompt", "x", "--threads", "2",
                                                                   "--temperature", "0.5", "--stop", "a"]))
    assert RunOptions(**typed) == RunOptions(num_threads=2, temperature=0.5, stop=("a",))
    bad = typed_run_options(build_parser("generate").parse_args(["generate", "--prompt", "x", "--threads", "two"]))
    with pytest.raises(InvalidOption, match="^--threads takes a whole number, got 'two'$"):
        RunOptions(**bad)
