"""The ``graftblock`` command line: one entry point above every package (see :mod:`graftblock.cli`)."""
