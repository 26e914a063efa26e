"""Subcommands of the ``sssd`` CLI; importing this package registers them."""

from sssd.commands import build, calibrate, draft, info, models, verify  # noqa: F401
