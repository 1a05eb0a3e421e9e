"""The CLI's console and its one-line error exit, shared by every command module.

User errors print as ``error: <message>`` and exit 2. Messages are escaped because rich would
otherwise read text such as ``pip install 'fuseflow[bench]'`` as markup and drop the brackets.
"""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

console = Console()


def fail(message: str, code: int = 2) -> None:
    """Print ``message`` as a one-line error and exit with ``code`` (2: bad input)."""
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def make_progress(console: Console) -> Progress:
    """The progress bar every long command shows: description, bar, done/total, elapsed and remaining time."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console, transient=False)
