"""A `switchboard` subcommand as data: the table `switchboard.cli` builds its parser from."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

Handler = Callable[[argparse.Namespace], int]


def _no_arguments(parser: argparse.ArgumentParser) -> None:
    """For subcommands without options."""


@dataclass(frozen=True)
class Command:
    """One subcommand: its words (`("model", "prepare")`), help line, options and handler."""

    words: tuple[str, ...]
    help: str
    run: Handler
    add_arguments: Callable[[argparse.ArgumentParser], None] = _no_arguments
