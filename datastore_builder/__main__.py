"""``python -m sssd.datastore_builder ARGS`` is ``sssd build ARGS``."""

import sys

from sssd.cli import main

if __name__ == "__main__":
    sys.exit(main(["build", *sys.argv[1:]]))
