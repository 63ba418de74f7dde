# One image for the router and the simulated GPU workers.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY router ./router
COPY policies ./policies
COPY state ./state
COPY sim ./sim
COPY simcluster ./simcluster
COPY bench ./bench
COPY launcher ./launcher
COPY uvrun ./uvrun
RUN pip install --no-cache-dir .
USER nobody
ENTRYPOINT ["disagg-router"]
