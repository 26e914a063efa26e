"""Subcommands of the ``sssd`` CLI; importing this package registers them."""

from sssd.commands import build, calibrate, draft, groundtruth, info, models, plan, serve, verify  # noqa: F401  # noqa: F401
