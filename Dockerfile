# The dflash-serve image: the Ray head and the Ray workers of k8s/ run it alike (KubeRay starts Ray
# in it; Ray Serve imports target_service.serving.deploy:app_builder from it).
#
# Base: NVIDIA's CUDA 13.0 runtime on Ubuntu 24.04. torch 2.13.0 from PyPI is a CUDA 13.0 build (it
# requires cuda-toolkit 13.0.3), so the image's CUDA and torch's agree and the one driver floor is
# CUDA 13.0's (>= 580; the H200 hosts this was developed on run 580.159). Ubuntu 24.04's Python is
# 3.12, the Python of the project's GPU runs. Not rayproject/ray: its CUDA 12 tags do not match
# torch 2.13's CUDA 13, and its Python stack would be replaced anyway; Ray is pinned below instead,
# to the rayVersion of k8s/base/rayservice.yaml.
#
# No secret is baked in: the API key and the admin token are files mounted from a Kubernetes Secret
# at run time (k8s/README.md). Build: docker build -t dflash-serve:0.1.0 .
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RAY_USAGE_STATS_ENABLED=0

# Triton compiles its launcher stubs with the C compiler and Python's headers at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
        ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# A non-root user, uid and gid 1000 (the pods' runAsUser and fsGroup); Ubuntu's own user 1000 goes.
RUN (userdel --remove ubuntu 2>/dev/null || true) && (groupdel ubuntu 2>/dev/null || true) \
    && groupadd --gid 1000 dflash \
    && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash dflash

# The environment belongs to root and is read-only to the user.
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# Dependencies first (a layer that changes only with pyproject.toml), then the package.
WORKDIR /src
COPY pyproject.toml README.md ./
RUN pip install "torch==2.13.0" "ray[serve]==2.60.0"
COPY foundation foundation
COPY kernels kernels
COPY kvpool_service kvpool_service
COPY drafter_service drafter_service
COPY target_service target_service
COPY training training
COPY dflash_cli dflash_cli
RUN pip install "torch==2.13.0" "ray[serve]==2.60.0" . \
    && python -c "import ray, torch, target_service.serving.deploy; assert ray.__version__ == '2.60.0'" \
    && rm -rf /src

USER 1000:1000
WORKDIR /home/dflash
ENV HOME=/home/dflash

# 8000: the OpenAI HTTP API (Ray Serve's proxy); 50051: replica 0's admin gRPC (replica i: +i).
EXPOSE 8000 50051
CMD ["dflash", "serve", "--help"]
