"""render.py: what the CLI prints: sizes in human units and tables as plain text when not a terminal."""

import pytest

from fluxtrt import render


@pytest.mark.parametrize("n,text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KB"), (5 * 2**20, "5.0 MB"),
                                    (3 * 2**40, "3072.0 GB")])
def test_human_sizes(n, text):
    assert render.human(n) == text


def test_a_table_prints_every_cell(capsys):
    render.out.print(render.table("title", ("a", "b"), [("x1", "y1"), ("x2", "y2")]))
    printed = capsys.readouterr().out
    assert all(cell in printed for cell in ("title", "x1", "y1", "x2", "y2"))
