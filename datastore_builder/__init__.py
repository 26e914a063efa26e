"""Offline datastore building (``sssd build``); installed as ``sssd.datastore_builder``."""
