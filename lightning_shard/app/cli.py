"""What our commands share about bad input: one line on stderr and exit status 2 (argparse's status), never
a traceback or a page of usage. Hydra's own report of a config that does not compose is several lines, a
hint about HYDRA_FULL_ERROR and exit status 1; ``run_hydra`` and ``bad_input`` fold it into that one line.

``HYDRA_FULL_ERROR=1`` still shows the full traceback, as in any Hydra app.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, NoReturn

# the user's wish, read before run_hydra sets the variable for Hydra's sake
FULL_ERROR = os.environ.get("HYDRA_FULL_ERROR") == "1"


def fail(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


@contextmanager
def bad_input(prog: str, *errors: type[BaseException]) -> Iterator[None]:
    """Inside, ``errors`` are the user's input (a config, an override, an option's value): said in one line."""
    try:
        yield
    except errors as err:
        if FULL_ERROR:
            raise
        fail(prog, one_line(err))


def run_hydra(prog: str, hydra_main: Callable[[], Any]) -> Any:
    """Runs a ``@hydra.main`` function; overrides that do not parse or compose are one line and exit 2."""
    from hydra.errors import ConfigCompositionException, OverrideParseException, SearchPathException

    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises what it would print, for bad_input to say
    with bad_input(prog, ConfigCompositionException, OverrideParseException, SearchPathException):
        return hydra_main()


def one_line(err: BaseException) -> str:
    """A Hydra or OmegaConf error in one line: its first sentences, without search paths, carets or frames."""
    from hydra.errors import InstantiationException, MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(err, InstantiationException) and err.__cause__ is not None:
        err = err.__cause__  # the option's own message, not Hydra's "Error in call to target ..."
    lines = [line.strip() for line in str(err).split("\n\n")[0].splitlines() if line.strip() not in ("", "^")]
    if isinstance(err, MissingConfigException):
        return f"{lines[0]} (options: {', '.join(err.options)})" if err.options else lines[0]
    if isinstance(err, OverrideParseException):
        return f"cannot parse the override {err.override!r}: {'; '.join(lines)}"
    if isinstance(err, OmegaConfBaseException):
        return f"{lines[0]} (at {err.full_key})" if getattr(err, "full_key", None) else lines[0]
    return " ".join(lines) or type(err).__name__


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse prints the whole usage first; --help shows it)."""

    def error(self, message: str) -> NoReturn:
        fail(self.prog, f"{message} (see --help)")


def at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer no smaller than ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}; got {text!r}")
        return value

    return parse
