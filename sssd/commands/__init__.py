"""Subcommands of the ``sssd`` CLI; importing this package registers them."""

from sssd.commands import draft, info  # noqa: F401
