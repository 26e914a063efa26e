"""Subcommands of the ``sssd`` CLI; importing this package registers them."""

from sssd.commands import build, calibrate, draft, info, serve, verify  # noqa: F401
from sssd.commands import groundtruth, models, plan  # noqa: F401
