# One image for every covey role (CPU PyTorch): the coordinator, workers and validators.
#
#   docker build -t covey .
#   docker run -p 8470:8470 -v "$PWD/configs:/configs:ro" covey \
#       coordinator /configs/network/diloco-nano.toml --host 0.0.0.0
#   docker run covey worker --coordinator http://HOST:8470 --stake 10 \
#       --blob-host 0.0.0.0 --advertise-host THIS_HOST
#
# compose.yaml starts a coordinator and two workers with it: `docker compose up --build`.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# PyTorch first, from its CPU index, so that resolving covey's `torch>=2.4` never pulls the
# multi-GB CUDA wheels (as scripts/dev.py does). For GPUs, build with
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 (or another CUDA index).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install "torch>=2.4,<3" --index-url "${TORCH_INDEX}"

# The package only, with no extras: a worker needs no plots, trackers or test tools. A
# coordinator on PostgreSQL and S3 needs --build-arg EXTRAS="[scale]" (compose.scale.yaml).
ARG EXTRAS=""
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY covey ./covey
RUN pip install ".${EXTRAS}" && rm -rf /src

# Not root. The run directory and the identity keys are volumes, so that a restarted
# container resumes its run and keeps its identity (and so its stake and earnings).
RUN useradd --create-home --uid 1000 covey \
    && mkdir -p /home/covey/runs /home/covey/keys \
    && chown -R covey:covey /home/covey
USER covey
WORKDIR /home/covey
VOLUME ["/home/covey/runs", "/home/covey/keys"]
EXPOSE 8470

ENTRYPOINT ["covey"]
CMD ["--help"]
