# One image for the API, the workers and the one-shot migration.
# TORCH_SPEC picks the PyTorch build: the default CUDA 12.8 wheels for a GPU worker; pass
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu for a CPU-only image.
# No secret is built in: passwords and tokens come from the environment at run time (compose
# reads them from .env, which .dockerignore keeps out of the build context). Each service's
# healthcheck is in docker-compose.yml: the API and a worker are checked differently.

# The web app's front-end packages, exactly as app/web/package-lock.json pins them (make web).
FROM node:20-slim AS web
WORKDIR /web
COPY app/web/package.json app/web/package-lock.json ./
RUN npm ci --no-audit --no-fund

FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cu128"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MUONFORGE_ARTIFACT_DIR=/artifacts

WORKDIR /app
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "$TORCH_SPEC"

COPY pyproject.toml README.md ./
COPY contract ./contract
COPY optim ./optim
COPY app ./app
COPY --from=web /web/node_modules ./app/web/node_modules
COPY worker ./worker
COPY muonforge ./muonforge
COPY alembic.ini ./
COPY migrations ./migrations
COPY examples ./examples
# Editable: app.db.migrate finds alembic.ini and migrations/ beside the packages. The image runs
# the API, the migration and the workers: the server and the training engine (pyproject.toml).
RUN pip install --no-cache-dir -e '.[server,train]'

RUN useradd --create-home --uid 1000 muonforge && mkdir -p /artifacts && chown muonforge /artifacts
USER muonforge
EXPOSE 8000
CMD ["muonforge", "api", "--host", "0.0.0.0", "--port", "8000"]
