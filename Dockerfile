# Image used by docker-compose.yml for the api, worker, beat and flower services.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY tokenfleet ./tokenfleet
COPY workers ./workers
COPY web ./web
COPY migrations ./migrations
# The data dir (ledger spill files, batch uploads, the demo key) belongs to the
# user the processes run as: a named volume mounted there is initialised from
# the image, ownership included, so it starts writable by that user.
ENV TOKENFLEET_DATA_DIR=/var/lib/tokenfleet
RUN pip install --no-cache-dir -e '.[flower]' \
    && useradd --create-home --uid 10001 tokenfleet \
    && mkdir -p /var/lib/tokenfleet \
    && chown -R tokenfleet:tokenfleet /var/lib/tokenfleet
USER tokenfleet
VOLUME /var/lib/tokenfleet
CMD ["tokenfleet", "--help"]
