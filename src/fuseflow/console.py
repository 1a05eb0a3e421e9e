"""The CLI's console and its one-line error exit, shared by every command module.

User errors print as ``error: <message>`` on stderr, one line whatever the terminal width, and exit 2;
progress and results go to stdout, so ``fuseflow config show > cfg.yaml`` never captures an error.
Messages are escaped because rich would otherwise read text such as ``pip install 'fuseflow[bench]'``
as markup and drop the brackets.
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
    """Print ``message`` on stderr as a one-line error and exit with ``code`` (2: bad input)."""
    # A fresh Console each time: it must write to the sys.stderr of the moment (typer's CliRunner swaps it).
    line = " ".join(str(message).split())  # one line even if a library's message had newlines
    Console(stderr=True).print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def make_progress(console: Console) -> Progress:
    """The progress bar every long command shows: description, bar, done/total, elapsed and remaining time."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console, transient=False)
