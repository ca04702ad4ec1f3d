"""Lines a user reads stay whole: one write per line (horovodrun tags each write, so a line written
in two pieces is split across two tagged lines), and launch-tf names a rank once."""
from __future__ import annotations

import io
import threading

from distmem.cli.launch_tf import _pump
from distmem.console import echo


class Writes(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.calls = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return super().write(s)


def test_echo_is_one_write_with_its_newline():
    out = Writes()
    echo("[rank 0] plot written to runs/demo/report.png", file=out)
    echo("a\nb", file=out)
    assert out.calls == ["[rank 0] plot written to runs/demo/report.png\n", "a\nb\n"]


def test_print_would_split_the_line():
    """Why echo exists: print() writes the text and the newline apart."""
    out = Writes()
    print("[rank 0] plot written", file=out, flush=True)
    assert out.calls == ["[rank 0] plot written", "\n"]


def test_launch_tf_names_the_rank_once():
    src = io.BytesIO(b"[rank 0] report: 4 of 4 ranks reporting\n[distmem rank 0] note\nplain\n[rank 1] other\n")
    out = io.StringIO()
    _pump(src, "[rank 0] ", out, threading.Lock(), 0)
    assert out.getvalue().splitlines() == ["[rank 0] report: 4 of 4 ranks reporting", "[rank 0] [distmem] note",
                                           "[rank 0] plain", "[rank 0] [rank 1] other"]
