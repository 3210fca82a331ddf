"""Entry point: ``tokenfleet <command> ...``.

Each module in ``tokenfleet.cli.commands`` contributes one subcommand through
``register(subparsers)``; the parser sets ``func`` to run it. A
:class:`~tokenfleet.errors.TokenFleetError` becomes one clear line on stderr
and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from typing import NoReturn

from tokenfleet import __version__
from tokenfleet.errors import TokenFleetError


class _Parser(argparse.ArgumentParser):
    """Bad flags print one line and exit 2, like every other user error."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tokenfleet",
        description="TokenFleet: goodput-first scheduling for LLM inference fleets.",
    )
    parser.add_argument("--version", action="version", version=f"tokenfleet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from tokenfleet.cli import commands

    for mod in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{mod.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except TokenFleetError as exc:
        print(f"tokenfleet: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("tokenfleet: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
