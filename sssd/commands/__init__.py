"""Subcommands of the ``sssd`` CLI; importing this package registers them."""

from sssd.commands import build, calibrate, draft, groundtruth, info, models, verify  # noqa: F401
