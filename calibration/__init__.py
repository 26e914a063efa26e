"""Replay evaluation and the grid-search calibration tool (``sssd calibrate``);
installed as ``sssd.calibration``."""
