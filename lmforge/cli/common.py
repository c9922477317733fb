"""Small pieces shared by the CLI modules."""

from __future__ import annotations

import argparse
import math
import re
import sys

from lmforge.errors import UserError


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage + error on bad arguments; we print one line and exit 2.

    A value that starts with a minus and a digit (``-1``, ``-1ba``, ``-5min``, ``-7B``) is a value,
    never an option: argparse's own rule takes only bare numbers, so ``--time -5min`` was "expected
    one argument" instead of the flag's own refusal of a negative time."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?[0-9].*$")

    def error(self, message: str):  # argparse API
        sys.stderr.write(f"error: {self.prog}: {message} (see `{self.prog} --help`)\n")
        sys.exit(2)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show defaults next to options and keep description paragraphs as written.

    Flags and options whose default is "not given" (None, False, []) show no default.
    """

    def _get_help_string(self, action):
        if action.default in (None, False, [], argparse.SUPPRESS) or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _shown(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def bounded(kind: type, low: float | None = None, high: float | None = None, *, above: bool = False,
            below: bool = False):
    """An argparse type: a finite ``int`` or ``float`` in [low, high] (``above``: low itself
    excluded; ``below``: high itself excluded). The refusal names the flag (argparse adds it) and the
    range expected."""
    word = "a whole number" if kind is int else "a number"
    lo = "" if low is None else (f"above {_shown(low)}" if above else f"at least {_shown(low)}")
    hi = "" if high is None else (f"below {_shown(high)}" if below else f"at most {_shown(high)}")
    expected = f"{word} {' and '.join(p for p in (lo, hi) if p)}".strip()

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if (value is None or not math.isfinite(value) or (low is not None and (value < low or (above and value == low)))
                or (high is not None and (value > high or (below and value == high)))):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


positive_int = bounded(int, 1)  # 0 refused, never read as "not given"


DEVICES = "auto, cpu, cuda, cuda:N or mps"


def add_device_argument(p) -> None:
    """``--device``, the same in every command that runs a model outside a run (eval, generate)."""
    p.add_argument("--device", default="auto", metavar="DEVICE",
                   help=f"where to run: {DEVICES} (auto: the first GPU if there is one, else the CPU)")


def torch_device(name: str):
    """The torch device ``--device`` names; one line when it is none, or absent here."""
    import torch  # (lazy: `lmforge --help` stays free of torch)

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r}: not a torch device (expected {DEVICES})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available on this machine")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {name}: MPS (Apple GPUs) is not available on this machine")
    return device


def as_sentence(text: str) -> str:
    """A command's one-line help as the first sentence of its --help page: capitalized, ended."""
    text = text.strip()
    return text[:1].upper() + text[1:] + ("" if text.endswith((".", "?", "!")) else ".")


def add_command(subparsers, name: str, help: str, description: str | None = None):
    """Add a subcommand whose --help shows defaults and whose errors are one line. Its one-line
    ``help`` (in the parent's list) is lower case; its page's ``description`` is sentences, the
    help made one where none is given."""
    return subparsers.add_parser(
        name,
        help=help,
        description=description or as_sentence(help),
        formatter_class=HelpFormatter,
    )
