# Image used by docker-compose.yml for the api, worker and beat services.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY tokenfleet ./tokenfleet
COPY workers ./workers
COPY web ./web
COPY migrations ./migrations
RUN pip install --no-cache-dir -e . && useradd --create-home tokenfleet
USER tokenfleet
ENV TOKENFLEET_DATA_DIR=/home/tokenfleet/.tokenfleet
CMD ["tokenfleet", "--help"]
