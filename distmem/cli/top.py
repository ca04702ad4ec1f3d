"""``distmem top PATH...``: a live view of every rank of a running job, by rank instead of by device.

    distmem top runs/x/timeline.json                  # the JSON ReportEvery(path=...) rewrites
    distmem top /var/lib/node_exporter/               # every *.prom / *.json in a folder (one per host, say)
    distmem top runs/x/ --once                        # one plain table, for scripts
    distmem top runs/x/ --json                        # the model as JSON

PATH: report / timeline JSON files, Prometheus textfiles (``.prom``), or folders holding them (names
starting with a dot are skipped: atomic writes' temporary files). Rows merge by job and rank; in a
folder another user can write, only this user's own files are read (another user's are named,
never shown as this job's), and every text from a file is shown with its control characters escaped. Each refresh stats every file and
reads only those whose modification time or size changed. Keys: q quit, s sort (rank, peak,
current, peak/plan, host), r reverse, h collapse hosts, j/k (or arrows) scroll, p pause. Colours
on a terminal: red above the plan, yellow within 10% of it, new warnings yellow.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import sys
import time
from typing import Dict, List, Optional, Tuple

from .. import untrusted
from ..errors import ConfigError
from ..report.live import SORTS, LiveJob, ViewState, render
from ..report.sinks.files import MAX_REPORT_BYTES
from ..untrusted import printable

__all__ = ["add_arguments", "run", "Watcher"]

from .checks import positive_number  # noqa: E402 - after __all__, like the rest of cli/


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="report/timeline JSON files, Prometheus .prom textfiles, or folders holding them")
    p.add_argument("--once", action="store_true", help="print one plain table and exit (scripts)")
    p.add_argument("--json", action="store_true", help="print the model (every rank, host totals, warnings) as JSON")
    p.add_argument("--interval", type=_interval, default=0.5, help="seconds between refreshes (default 0.5)")
    p.add_argument("--sort", choices=SORTS, default="rank")
    p.add_argument("--collapse", action="store_true", help="one line per host")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="colours: auto (on a terminal), always, never")
    p.add_argument("--duration", type=positive_number, default=None, help="leave after this many seconds (live view)")


class Watcher:
    """The files behind the view; :meth:`poll` re-reads only those whose (mtime, size) changed. Each
    is read with the checks of :mod:`distmem.untrusted`: never through a link, never blocking on a
    FIFO, at most :data:`MAX_REPORT_BYTES`, and in a folder another user can write only this user's
    own files (another user's is named among the errors, not shown as this job's)."""

    def __init__(self, paths: List[str]):
        for p in paths:
            if not os.path.exists(p):
                raise ConfigError(f"{p!r} does not exist; give the report JSON a job writes "
                                  "(ReportEvery(path=...)), its Prometheus textfile (prometheus=...), or their folder")
        self.paths = paths
        self.stamps: Dict[str, Tuple[int, int]] = {}
        self.reads = 0
        self.others: Dict[str, List[str]] = {}  # folder -> names that are not .json/.prom (for the 'nothing found' line)

    def files(self) -> List[str]:
        out: List[str] = []
        for p in self.paths:
            if os.path.isdir(p):
                try:
                    with untrusted.folder(p, follow=True) as f:
                        out += [os.path.join(p, n) for n in f.names() if _wanted(n)]
                except OSError:
                    continue
            else:
                out.append(p)
        return sorted(out)

    def poll(self, job: LiveJob) -> int:
        """Read what changed into ``job``; the number of files read."""
        n = 0
        present: set = set()
        for p in self.paths:
            if os.path.isdir(p):
                try:
                    with untrusted.folder(p, follow=True) as f:
                        names = f.names()
                        self.others[p] = [x for x in names if not _wanted(x) and not x.startswith(".")]
                        for name in names:
                            if not _wanted(name):
                                continue
                            path = os.path.join(p, name)
                            present.add(path)
                            n += self._take(job, path, lambda nm=name: os.stat(nm, dir_fd=f.fd, follow_symlinks=False),
                                            lambda nm=name: f.read(nm, max_bytes=MAX_REPORT_BYTES, what="the file"))
                except OSError as exc:
                    job.errors[p] = f"the folder cannot be read ({exc.strerror or exc})"
            else:
                present.add(p)
                n += self._take(job, p, lambda path=p: os.stat(path, follow_symlinks=False),
                                lambda path=p: untrusted.read_bytes(path, max_bytes=MAX_REPORT_BYTES, what="the file"))
        for gone in set(self.stamps) - present:
            self.stamps.pop(gone)
            job.forget(gone)
        self.reads += n
        return n

    def _take(self, job: LiveJob, path: str, stat_of, read) -> int:
        try:
            st = stat_of()
        except OSError:
            return 0
        stamp = (st.st_mtime_ns, st.st_size)
        if self.stamps.get(path) == stamp:
            return 0
        self.stamps[path] = stamp
        try:
            data = read()
        except untrusted.Unsafe as exc:
            job.forget(path)
            job.errors[path] = exc.why
            return 0
        except OSError:
            self.stamps.pop(path, None)
            return 0
        job.update(path, data.decode("utf-8", errors="replace"), owner=st.st_uid)
        return 1


def _wanted(name: str) -> bool:
    return not name.startswith(".") and name.endswith((".json", ".prom"))


def _nothing_found(watcher: Watcher, job: LiveJob, paths: List[str]) -> str:
    """What was found where no report was, and why each is not one."""
    if job.errors:
        why = "; ".join(f"{printable(os.path.basename(src), 80)}: {printable(err, 160)}"
                        for src, err in sorted(job.errors.items())[:5])
        more = f" (and {len(job.errors) - 5} more)" if len(job.errors) > 5 else ""
        return (f"no distmem report in {', '.join(paths)}: {len(job.errors)} file(s) ending in .json or .prom, none "
                f"a report of this user's: {why}{more}; give the files ReportEvery(path=..., prometheus=...) or "
                "distmem.report(path=...) writes")
    others = [n for names in watcher.others.values() for n in names]
    seen = (f" (it holds {len(others)} other file(s), e.g. {', '.join(printable(n, 60) for n in others[:3])})"
            if others else " (it is empty)")
    return (f"no report file found in {', '.join(paths)}: nothing ending in .json or .prom{seen}; is the job writing "
            "them (ReportEvery(path=..., prometheus=...))?")


def _once(job: LiveJob, state: ViewState, color: bool) -> None:
    width = shutil.get_terminal_size((160, 40)).columns if sys.stdout.isatty() else 200
    print("\n".join(render(job, state, width=width, color=color, keys=False)))


def _interval(text: str) -> float:
    value = positive_number(text)
    if not 0.05 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds between 0.05 and 3600, e.g. 0.5")
    return value


def run(args: argparse.Namespace) -> int:
    missing = [p for p in args.paths if not os.path.exists(p)]
    if missing:
        raise ConfigError(f"{', '.join(repr(p) for p in missing)}: no such file or folder; give the folder (or files) "
                          "where the job writes its reports (ReportEvery(path=..., prometheus=...), DISTMEM_REPORT)")
    watcher = Watcher(args.paths)
    job = LiveJob()
    state = ViewState(sort=args.sort, collapsed=args.collapse)
    watcher.poll(job)
    tty = sys.stdout.isatty()
    color = args.color == "always" or (args.color == "auto" and tty and os.environ.get("NO_COLOR") is None)
    if args.json:
        print(json.dumps(job.to_dict(), indent=1, default=str))
        return 0
    if args.once or not tty:
        if not job.by_source:
            raise ConfigError(_nothing_found(watcher, job, args.paths))
        _once(job, state, color)
        return 0
    return _live(watcher, job, state, color, args.interval, args.duration)


def _live(watcher: Watcher, job: LiveJob, state: ViewState, color: bool, interval: float,
          duration: Optional[float]) -> int:
    import termios
    import tty as tty_mod

    fd = sys.stdin.fileno() if sys.stdin.isatty() else None
    saved = termios.tcgetattr(fd) if fd is not None else None
    out = sys.stdout
    out.write("\x1b[?1049h\x1b[?25l")  # the alternate screen, no cursor
    t_end = None if duration is None else time.monotonic() + duration
    try:
        if fd is not None:
            tty_mod.setcbreak(fd)
        frames = 0
        while True:
            if not state.paused:
                watcher.poll(job)
            size = shutil.get_terminal_size((120, 40))
            lines = render(job, state, width=size.columns, height=size.lines - 1, color=color)
            frames += 1
            out.write("\x1b[H" + "\x1b[K\n".join(lines) + "\x1b[K\n\x1b[J")
            out.write(f"\x1b[2m frame {frames}, {watcher.reads} file read(s)\x1b[0m\x1b[K" if color else
                      f" frame {frames}, {watcher.reads} file read(s)")
            out.flush()
            deadline = time.monotonic() + interval
            while True:
                left = deadline - time.monotonic()
                if t_end is not None:
                    left = min(left, t_end - time.monotonic())
                if left <= 0:
                    break
                if fd is None:
                    time.sleep(left)
                    break
                ready, _, _ = select.select([fd], [], [], left)
                if not ready:
                    break
                changed = False
                for key in _keys(os.read(fd, 64).decode(errors="replace")):
                    if key in ("q", "Q", "\x03"):
                        return 0
                    changed = _key(key, state) or changed
                if changed:
                    break  # redraw at once
            if t_end is not None and time.monotonic() >= t_end:
                return 0
    finally:
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)
        out.write("\x1b[?25h\x1b[?1049l")
        out.flush()


def _keys(text: str) -> List[str]:
    """Keys typed since the last read: escape sequences (arrows, page down) kept whole."""
    out: List[str] = []
    i = 0
    while i < len(text):
        if text[i] == "\x1b" and text[i + 1:i + 2] == "[":
            j = i + 2
            while j < len(text) and not text[j].isalpha() and text[j] != "~":
                j += 1
            out.append(text[i:j + 1])
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return out


def _key(key: str, state: ViewState) -> bool:
    """Apply a key; True when the view changed."""
    if key == "s":
        state.next_sort()
    elif key == "r":
        state.reverse = not state.reverse
    elif key == "h":
        state.collapsed = not state.collapsed
        state.offset = 0
    elif key in ("j", "\x1b[B"):
        state.offset += 1
    elif key in ("k", "\x1b[A"):
        state.offset = max(0, state.offset - 1)
    elif key == " " or key == "\x1b[6~":
        state.offset += 20
    elif key == "p":
        state.paused = not state.paused
    else:
        return False
    return True
