"""The extras a service command needs, checked against what is installed before any import.

The extras are pyproject.toml's ``server`` and ``train``: a client-only install (``pip install
muonforge``) answers ``muonforge up`` with one line naming what to install, not a traceback. The
packages of each extra are read from the installed distribution's own metadata, so
pyproject.toml stays the one place that lists them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from importlib import metadata

DISTRIBUTION = "muonforge"
WHAT = {"server": "the server", "train": "the training engine"}
NAMED = 4  # missing packages named in the line; the rest are counted


class MissingExtras(Exception):
    """A service command whose extras are not installed: the line to print."""


def missing(extras: Iterable[str]) -> list[str]:
    """The packages that ``extras`` require and that are not installed, sorted. None when this
    distribution's metadata is absent (the code run from a source tree): nothing to check."""
    from packaging.requirements import Requirement  # here: the client commands never need it

    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return []
    names = set()
    for line in requires:
        requirement = Requirement(line)
        if requirement.marker and any(requirement.marker.evaluate({"extra": extra}) for extra in extras):
            names.add(requirement.name)
    return sorted(name for name in names if not installed(name))


def installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def needs(*extras: str) -> Callable:
    """Decorate a command (``args -> exit status``) that needs ``extras``: it raises
    MissingExtras, before running, while a package of them is not installed."""

    def decorate(command: Callable) -> Callable:
        @functools.wraps(command)
        def checked(args) -> int:
            if absent := missing(extras):
                raise MissingExtras(explain(args.command, extras, absent))
            return command(args)

        return checked

    return decorate


def explain(command: str, extras: tuple[str, ...], absent: list[str]) -> str:
    """``muonforge up needs the server and the training engine (not installed: …): pip install …``."""
    what = " and ".join(WHAT[extra] for extra in extras)
    more = f" and {len(absent) - NAMED} more" if len(absent) > NAMED else ""
    names = ", ".join(absent[:NAMED]) + more
    return f"muonforge {command} needs {what} (not installed: {names}): pip install 'muonforge[{','.join(extras)}]'"
