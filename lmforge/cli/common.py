"""Small pieces shared by the CLI modules."""

from __future__ import annotations

import argparse
import sys


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage + error on bad arguments; we print one line and exit 2."""

    def error(self, message: str):  # argparse API
        sys.stderr.write(f"error: {self.prog}: {message} (see `{self.prog} --help`)\n")
        sys.exit(2)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show defaults next to every option and keep description paragraphs as written."""


def add_command(subparsers, name: str, help: str, description: str | None = None):
    """Add a subcommand whose --help shows defaults and whose errors are one line."""
    return subparsers.add_parser(
        name,
        help=help,
        description=description or help,
        formatter_class=HelpFormatter,
    )
