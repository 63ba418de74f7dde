# One image for the router and the simulated GPU workers.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY router ./router
COPY policies ./policies
COPY state ./state
COPY disagg_tools ./disagg_tools
RUN pip install --no-cache-dir .
USER nobody
ENTRYPOINT ["disagg-router"]
