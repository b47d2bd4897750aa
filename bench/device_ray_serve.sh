#!/usr/bin/env bash
# Builds .devray-serve/: a core Ray that keeps Ray Serve, so a device run can measure
# `dflash serve --services ray` (Serve's FastAPI ingress) on the H200. It replaces .devray (whose cut,
# ../shared/tools/device_ray.sh, drops ray/serve) rather than joining it: the two do not fit the 64 MiB
# carry limit side by side with the tree and .whl. It carries no wheels of its own: what Serve imports
# beyond Ray core (fastapi, starlette, uvicorn, pydantic, prometheus_client, grpcio and
# grpcio-reflection, which ray/serve/_private/grpc_util.py imports unconditionally) is in .whl already,
# and so are jsonschema, referencing and rpds-py, which .devray duplicates. numpy, which
# serve/_private/autoscaling_metrics_codec.py imports unconditionally, comes with the image's torch.
# Ray core's own msgpack, pyyaml, requests, packaging and filelock are taken from the image, as .devray
# takes them.
#
# Kept that Serve needs: ray/serve (controller, proxy, replica, router), ray/dashboard/modules (the
# minimal dashboard head that ray.init starts even with include_dashboard=False imports most of them,
# serve's sdk among them), the runtime-env agent's vendored aiohttp (the raylet starts that agent).
# Dropped: what device_ray.sh drops (Java jars, RLlib, Data, Tune, Train, LLM, the dashboard UI), and
# ray/serve/llm (needs the dropped ray/llm), serve's benchmarks, type stubs and Cython headers
# (compile-time only); every ELF is stripped of symbols (Ray's three binaries are most of the bytes).
#
#   bash bench/device_ray_serve.sh                          (checkout root, once; about 4 minutes)
#   PY_VERSION=3.11 DEST=/tmp/x bash bench/device_ray_serve.sh   (the same cut for a local check)
#
# Then in each device run: carry [".devray-serve", ".whl"] and start the command with
#   mkdir -p /tmp/site && tar -xJf .devray-serve/ray-serve.tar.xz -C /tmp/site && python3 -m pip install
#     -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
#     export PYTHONPATH=/tmp/site:$PWD RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 &&
# and start Ray with ray.init(address="local", include_dashboard=False).
set -euo pipefail
cd "$(dirname "$0")/.."
RAY_VERSION=${RAY_VERSION:-2.60.0}
PY_VERSION=${PY_VERSION:-3.12}
DEST=${DEST:-.devray-serve}
if [ "$DEST" = .devray-serve ]; then  # ignored, as device_ray.sh ignores .devray
    exclude=$(git rev-parse --git-path info/exclude)
    grep -qx "/$DEST/" "$exclude" 2> /dev/null || echo "/$DEST/" >> "$exclude"
fi
mkdir -p "$DEST" && dest=$(cd "$DEST" && pwd) && tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$tmp" "ray==$RAY_VERSION"
mkdir "$tmp/x" && cd "$tmp/x" && unzip -q ../ray-*.whl
rm -rf ray/jars ray/rllib ray/data ray/tune ray/train ray/llm ray/dashboard/client \
    ray/serve/llm ray/serve/_private/benchmarks
find . \( -name tests -o -name __pycache__ \) -type d -prune -exec rm -rf {} +
find . \( -name '*.pyi' -o -name '*.pxd' -o -name '*.pxi' \) -type f -delete
find . -type f -print0 | while IFS= read -r -d '' f; do  # ELF magic: 7f 'E' 'L' 'F'
    if [ "$(head -c 4 "$f" | od -An -tx1 | tr -d ' \n')" = 7f454c46 ]; then strip --strip-unneeded "$f"; fi
done
# --x86 (a BCJ filter before LZMA2) takes about 1 MB (6%) more off the stripped binaries than -9e alone.
tar --sort=name --owner=0 --group=0 --numeric-owner -cf - . |
    xz -T2 --x86 --lzma2=preset=9e > "$dest/ray-serve.tar.xz"
du -b "$dest"/*
