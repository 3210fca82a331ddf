"""Live-service glue shared by the HTTP API (web/), the Celery workers (workers/)
and ``tokenfleet up``: Redis live state, the token relay, the engine client and
the metrics scraper. Policies stay in :mod:`tokenfleet.core`; this package only
builds their snapshots from Redis and carries their decisions out."""
