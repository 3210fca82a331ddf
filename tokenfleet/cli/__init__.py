"""The ``tokenfleet`` command line."""
