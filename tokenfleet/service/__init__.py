"""Persistence and infrastructure for the live service: config, embedded stores, ledger.

Nothing here is imported by the policy core; the Celery workers and HTTP API
build on :mod:`tokenfleet.service.config`, :mod:`tokenfleet.service.embedded`,
:mod:`tokenfleet.service.db` and :mod:`tokenfleet.service.ledger`.
"""
