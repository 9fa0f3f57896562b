"""Paths ampfx is given to write to, checked before any work.

A report's directory (``Report.save``, ``log_path`` / ``AMPFX_LOG_PATH``), a plot's file and the ``ampfx``
command's ``--out`` / ``--html`` / ``--json`` are each checked by :func:`check_writable` before the work that
ends in writing them: a place nothing can be written is a :class:`~ampfx.errors.PathError` naming the argument,
the path and what stands in the way, not an ``OSError`` from deep inside after minutes of work.

Permission bits do not say whether a folder can be written (``root`` passes ``os.access`` everywhere, ``/proc``
included, and a read-only or full file system is another matter), so the check does what the writer will do
first, once, where it will do it: it makes an entry of the same kind (a folder where folders are missing, else a
file) with a name of its own in the nearest folder that exists, and removes it at once, as :mod:`tempfile`
tries a folder before it uses it. Nothing else is created.

>>> check_writable("/proc/nope/range.png", "--out '/proc/nope/range.png'")  # doctest: +SKIP
Traceback (most recent call last):
...
ampfx.errors.PathError: --out '/proc/nope/range.png': cannot write there: the folder /proc/nope cannot be made (No such file or directory)
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

from .errors import PathError


def check_writable(path: str | os.PathLike, what: str, *, directory: bool = False) -> Path:
    """``path`` as a :class:`~pathlib.Path` when a file (``directory=False``) or a folder of files
    (``directory=True``) can be written there, folders still missing included; a :class:`PathError` whose
    message starts with ``what`` (the argument and its value, ``"--out 'x.png'"``) otherwise."""
    if not isinstance(path, (str, os.PathLike)):
        raise PathError(f"{what}: give a {'directory' if directory else 'file'} path (a str or pathlib.Path)")
    if not os.fspath(path):
        raise PathError(f"{what}: the path is empty; give a {'directory' if directory else 'file'} path")
    target = Path(path)
    if target.is_dir() and not directory:
        raise PathError(f"{what}: is a directory; give a file path")
    if target.exists() and directory and not target.is_dir():
        raise PathError(f"{what}: is a file, not a directory; give a directory path")
    if target.exists() and not directory:
        return _probe(what, lambda: open(target, "ab").close(), "", target)
    folder = target if directory else target.parent
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    if not folder.is_dir():
        raise PathError(f"{what}: cannot write there: {folder} is a file, not a directory")
    if missing:
        return _probe(what, lambda: os.rmdir(tempfile.mkdtemp(prefix=".ampfx-", dir=folder)),
                      f": the folder {missing[-1]} cannot be made", target)
    return _probe(what, lambda: _make_file(folder), f": nothing can be written in {folder}", target)


def _probe(what: str, attempt: Callable[[], None], failing: str, target: Path) -> Path:
    """``attempt()`` (the first entry the writer would make, made and removed): a :class:`PathError` saying
    ``failing`` and the system's reason when it fails."""
    try:
        attempt()
    except OSError as e:
        raise PathError(f"{what}: cannot write there{failing} ({e.strerror or e})") from None
    return target


def _make_file(folder: Path) -> None:
    """A file of its own made in ``folder`` and removed."""
    handle, name = tempfile.mkstemp(prefix=".ampfx-", dir=folder)
    os.close(handle)
    os.unlink(name)
