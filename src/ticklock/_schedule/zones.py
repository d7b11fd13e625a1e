"""IANA time zones read from the ``tzdata`` package, never from the system's database.

``zoneinfo.ZoneInfo(name)`` looks in the system's ``TZPATH`` (``/usr/share/zoneinfo``)
before the ``tzdata`` package, so two replicas of one release built on different base images
could read different rules for one zone and compute different instants for one cron. Reading
every zone from the files of the ``tzdata`` package ticklock depends on makes the rules a
property of the installed ``tzdata`` version alone: the same version on every replica, the
same instants.
"""

from __future__ import annotations

import functools
import importlib
from importlib import resources
from zoneinfo import ZoneInfo


class UnknownZone(LookupError):
    """A name that is not a zone of the installed ``tzdata`` package (or none is installed);
    the message says where ticklock looked."""


@functools.cache
def names() -> frozenset[str]:
    """Every zone name the installed ``tzdata`` ships, links (``US/Eastern``) included."""
    try:
        listing = resources.files("tzdata").joinpath("zones").read_text(encoding="utf-8")
    except ModuleNotFoundError:
        raise UnknownZone(
            "the tzdata package is not installed; ticklock reads zone rules only from it "
            "(pip install tzdata)"
        ) from None
    return frozenset(listing.split())


@functools.cache
def zone(name: str) -> ZoneInfo:
    """The zone ``name`` (an IANA key such as ``Europe/Berlin``) as ``tzdata`` defines it, one
    shared object per name; raises :class:`UnknownZone` for a name ``tzdata`` does not ship.

    The name is checked against ``tzdata``'s own list before any file is opened, so no name
    (``../x``, a directory, a module file of the package) can reach a file that is not a zone.
    """
    if name not in names():
        raise UnknownZone(f"ticklock reads zones from tzdata {version()}")
    path = resources.files("tzdata.zoneinfo").joinpath(*name.split("/"))
    with path.open("rb") as file:
        return ZoneInfo.from_file(file, key=name)


def version() -> str:
    """The IANA release of the installed ``tzdata`` (``2026a``): the rules every zone follows."""
    return str(importlib.import_module("tzdata").IANA_VERSION)  # the package ships no types
