"""The one base class of every error meant for the user.

A `UserError` is something the user can act on (a bad option, a missing or damaged model file, a full context,
a device that is not there): front ends print its first line and exit with status 2. Any other exception is a
bug and keeps its traceback.
"""
from __future__ import annotations


class UserError(Exception):
    """Printed as one line, exit status 2."""


class InvalidOption(UserError, ValueError):
    """An option or argument out of range or malformed (also a ValueError, for callers of the Python API)."""
