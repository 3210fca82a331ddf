"""Alembic migrations of the ledger schema (``env.py``, ``versions/``).

A package only so that a wheel ships it (``pip install .`` then ``tokenfleet db
upgrade`` / ``tokenfleet up`` migrate without a source checkout);
:func:`tokenfleet.service.db.migrations_dir` finds it. Alembic loads the files
by path, never by importing this package.
"""
