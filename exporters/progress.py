"""How exporters report long steps. The library stays silent; the CLI passes a rich progress bar."""

from __future__ import annotations


class Progress:
    """Silent progress: subclass and override to show it. One step at a time."""

    def begin(self, description: str, total: float | None = None) -> None:
        """A step starts; `total` is its amount of work (bytes, tensors) when known."""

    def advance(self, amount: float = 1) -> None:
        """Some of the current step's work is done."""

    def end(self) -> None:
        """The current step is finished."""

    def note(self, message: str) -> None:
        """A result worth showing (an acceptance rate, a check that passed)."""


SILENT = Progress()


class RichProgress(Progress):
    """A rich progress bar on stderr, one line per step (stdout stays clean for paths and JSON)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress as Bar, TaskProgressColumn, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self.bar = Bar(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                       console=self.console, transient=False)
        self.task = None

    def __enter__(self) -> "RichProgress":
        self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self.end()
        self.bar.stop()

    def begin(self, description: str, total: float | None = None) -> None:
        self.end()
        self.task = self.bar.add_task(description, total=total)

    def advance(self, amount: float = 1) -> None:
        if self.task is not None:
            self.bar.advance(self.task, amount)

    def end(self) -> None:
        if self.task is not None:
            task = self.bar.tasks[-1]
            self.bar.update(self.task, completed=task.total if task.total is not None else 1,
                            total=task.total if task.total is not None else 1)
            self.task = None

    def note(self, message: str) -> None:
        self.bar.console.print(message)
