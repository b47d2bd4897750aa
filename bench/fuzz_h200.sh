#!/usr/bin/env bash
# Schemathesis and the soak's poisons against dflash serve's app on the H200 (bench/fuzz_gpu.py).
# Carry [".whl"] (made by bench/device_wheels.sh): .whl/*.whl (pydantic, gRPC, protobuf, fastapi,
# uvicorn, ...) and .whl/fuzz/*.whl (schemathesis with its dependencies; for Python 3.12). The server's packages go to
# /tmp/site; schemathesis and its dependencies to /tmp/fuzz, which only its own process sees (its
# pytest and hypothesis are not the image's).
#
#   OUT=DIR bash bench/fuzz_h200.sh [--max-time-s 60]
set -euo pipefail
OUT=${OUT:-/tmp/fuzz_gpu}
mkdir -p "$OUT"
pip_into() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@"; }
pip_into /tmp/site .whl/*.whl
pip_into /tmp/fuzz .whl/fuzz/*.whl .whl/pydantic*.whl .whl/annotated_types*.whl .whl/typing_inspection*.whl
cat > /tmp/fuzz/schemathesis-run <<'RUN'
#!/usr/bin/env bash
PYTHONPATH=/tmp/fuzz exec python3 -c 'import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())' "$@"
RUN
chmod +x /tmp/fuzz/schemathesis-run
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
python3 -m bench.fuzz_gpu --schemathesis /tmp/fuzz/schemathesis-run --out "$OUT" "$@"
