"""Console output shared by all stages: messages on stderr, progress bars only where they help."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

T = TypeVar("T")

# (no emoji codes: ":x:" in an error sentence or a path stays as written)
console = Console(stderr=True, highlight=False, emoji=False)
out = Console(highlight=False, emoji=False)  # tables and reports a user may pipe


def info(msg: str) -> None:
    console.print(msg, soft_wrap=True)


def track(items: Iterable[T], description: str, total: int | None = None, enabled: bool = True) -> Iterator[T]:
    """Iterate with a rich progress bar (hidden when disabled or not attached to a terminal)."""
    if not enabled or not console.is_terminal:
        yield from items
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        yield from progress.track(items, total=total, description=description)


@contextlib.contextmanager
def status(msg: str, enabled: bool = True):
    if enabled and console.is_terminal:
        with console.status(msg):
            yield
    else:
        yield
