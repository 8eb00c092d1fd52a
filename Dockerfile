# syntax=docker/dockerfile:1
# rmqfast container image: `docker build -t rmqfast:0.1.0 .`
#
# Stage 1 builds the wheel, compiling the Cython hot path (ext/_speedups.pyx -> rmqfast._speedups),
# plus wheels of every dependency.  Stage 2 is a slim runtime without compilers that installs
# those wheels and runs as an unprivileged user.
#
#   docker run -d --name rmqfast \
#     -v "$PWD/rmqfast.toml:/etc/rmqfast/rmqfast.toml:ro" -v rmqfast-state:/var/lib/rmqfast \
#     -p 9876:9876 -p 9400:9400 -p 30900-30999:30900-30999 rmqfast:0.1.0
#
# The config must listen on 0.0.0.0 (and set proxy.advertise_host to the address clients use),
# keep admin.listen on port 9400 for the HEALTHCHECK (or set RMQFAST_HEALTH_URL), and put
# proxy.state_dir under /var/lib/rmqfast.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY ext/ ext/
COPY rmqfast/ rmqfast/
# pip builds rmqfast in an isolated environment with the build requirements of pyproject.toml
# (setuptools, wheel, Cython); setup.py cythonizes and compiles the extension.
RUN pip wheel --no-cache-dir --wheel-dir /wheels .
RUN python -m zipfile -l /wheels/rmqfast-*.whl | grep -q '_speedups.*\.so' \
 || { echo "the rmqfast wheel lacks the compiled rmqfast._speedups extension" >&2; exit 1; }

FROM ${PYTHON_IMAGE} AS runtime
ARG RMQFAST_UID=10001
RUN groupadd --system --gid ${RMQFAST_UID} rmqfast \
 && useradd --system --uid ${RMQFAST_UID} --gid rmqfast --home-dir /var/lib/rmqfast --no-create-home \
        --shell /usr/sbin/nologin rmqfast \
 && install -d -o rmqfast -g rmqfast -m 0750 /var/lib/rmqfast \
 && install -d -m 0755 /etc/rmqfast
COPY --from=builder /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links=/wheels rmqfast \
 && rm -rf /wheels \
 && python -c "import rmqfast.codec as c; assert c.IMPLEMENTATION == 'compiled', c.IMPLEMENTATION"

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    RMQFAST_HEALTH_URL=http://127.0.0.1:9400/healthz
WORKDIR /var/lib/rmqfast
VOLUME ["/etc/rmqfast", "/var/lib/rmqfast"]
# 9876 name-server listener, 9400 admin (/metrics, /healthz, /readyz), 30900-30999 the default
# brokers.port_range (each endpoint P also uses P - 2 for the VIP channel, inside the range).
EXPOSE 9876 9400 30900-30999
USER rmqfast:rmqfast

# The slim image has no curl: ask /healthz with the standard library.  The check runs in
# WORKDIR, the state directory: -I (isolated) keeps that directory (and PYTHON* variables) off
# sys.path, so a module planted there never runs.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-I", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['RMQFAST_HEALTH_URL'], timeout=4)"]

# The supervisor is PID 1: it handles SIGTERM (drain, then exit 0) and SIGHUP (reload), and
# reaps its own worker processes.
STOPSIGNAL SIGTERM
ENTRYPOINT ["rmqfast"]
CMD ["serve", "--config", "/etc/rmqfast/rmqfast.toml"]
