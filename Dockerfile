# A worker image: ratchet and its dependencies (the embedded Redis binary is not used here;
# compose points every process at the redis service).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir . && useradd --create-home ratchet
USER ratchet
WORKDIR /home/ratchet
CMD ["ratchet", "worker"]
