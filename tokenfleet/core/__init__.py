"""The policy core: pure decision code, no I/O, no clocks, no Celery.

Both the discrete-event simulator and the live service call these objects.
"""
