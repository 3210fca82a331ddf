"""Celery side of TokenFleet: the app, the request task, the worker runtime and beat."""
