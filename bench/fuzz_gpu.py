"""Schemathesis and the soak's poisons against `dflash serve`'s app on a GPU, where sampling runs on
the device (issue 30 asks for both there too; on CPU they are tests/serving/test_schemathesis.py and
the soak's). The app is one `Replica` of the demo pair under uvicorn in this process
(`bench.serve_in_process`: the H200 cannot carry Ray Serve), so "the engine never restarts" is read
as: the engine stays healthy, /health answers 200 after every phase, and a greedy completion asked
before the fuzz is the same after it.

    python -m bench.fuzz_gpu --schemathesis BIN --out DIR [--max-time-s 60] [--device cuda]

Writes DIR/fuzz_gpu.json: per mode the exit status, the case count and the summary's last lines;
per poison its status and any fault; the verdicts. Exit status 0 when every verdict holds.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.serve_in_process import replica_server
from bench.soak_poisons import POISONS, check_answer

MODES = ("positive", "negative")
IDLE = {"healthy": True, "running": 0, "waiting": 0, "used_blocks": 0}
PROBE = {"prompt": "def parse_args(argv):\n    parser = ", "max_tokens": 32, "temperature": 0}


def run_schemathesis(binary: str, url: str, mode: str, seed: int, max_time_s: int, out: Path) -> dict:
    command = [binary, "run", f"{url}/openapi.json", "--mode", mode, "--checks", "all",
               "--exclude-checks", "positive_data_acceptance", "--max-time", str(max_time_s),
               "--request-timeout", "30", "--workers", "1", "--seed", str(seed), "--no-color"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=max_time_s + 120, cwd=out)
    (out / f"schemathesis_{mode}.log").write_text(run.stdout + run.stderr)
    cases = re.search(r"(\d+) generated", run.stdout)
    return {"mode": mode, "seed": seed, "exit": run.returncode,
            "cases": int(cases.group(1)) if cases else None, "summary": run.stdout.strip().splitlines()[-12:]}


def send_poisons(url: str, model: str) -> list[dict]:
    answers = []
    with httpx.Client(base_url=url, timeout=60) as http:
        for poison in POISONS:
            reply = http.post("/v1/completions", content=poison.encode(model),
                              headers={"Content-Type": "application/json"})
            answers.append({"poison": poison.name, "status": reply.status_code,
                            "fault": check_answer(poison, reply.status_code, reply.text)})
    return answers


def greedy_text(url: str, model: str) -> str:
    reply = httpx.post(f"{url}/v1/completions", json={"model": model, **PROBE}, timeout=60)
    reply.raise_for_status()
    return reply.json()["choices"][0]["text"]


def healthy(url: str) -> bool:
    return httpx.get(f"{url}/health", timeout=10).status_code == 200


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemathesis", required=True, help="the schemathesis executable")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--max-time-s", type=int, default=60, help="per mode")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=time.time_ns() % 2**31)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from target_service.serving.serve_args import ServeArgs

    rng = random.Random(args.seed)
    settings = ServeArgs(device=args.device, max_model_len=128, max_num_seqs=8, kv_cache_memory="256MiB",
                         admin_port=None)
    doc = {"seed": args.seed, "device": args.device, "settings": settings.model_dump(mode="json")}
    with replica_server(settings) as (url, replica):
        model = settings.model_name
        before = greedy_text(url, model)
        doc["modes"], doc["health_after"] = [], []
        for mode in MODES:
            doc["modes"].append(run_schemathesis(args.schemathesis, url, mode, rng.randrange(2**31),
                                                 args.max_time_s, args.out))
            doc["health_after"].append(healthy(url))
        doc["poisons"] = send_poisons(url, model)
        doc["health_after"].append(healthy(url))
        doc["greedy_unchanged"] = greedy_text(url, model) == before
        time.sleep(1.0)  # the last closes reach the pool behind the step
        engine = replica.async_engine
        usage = engine.snapshot().pool
        doc["after"] = {"healthy": engine.is_healthy, "running": engine.num_running,
                        "waiting": engine.num_waiting, "used_blocks": usage.num_used_blocks}
    doc["verdicts"] = {
        "schemathesis found nothing": all(m["exit"] == 0 for m in doc["modes"]),
        "every poison got its answer": all(p["fault"] is None for p in doc["poisons"]),
        "healthy after every phase": all(doc["health_after"]),
        "greedy completion unchanged": doc["greedy_unchanged"],
        "engine healthy and idle, no page in use": doc["after"] == IDLE,
    }
    (args.out / "fuzz_gpu.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({"modes": [{k: m[k] for k in ("mode", "exit", "cases")} for m in doc["modes"]],
                      "verdicts": doc["verdicts"]}, indent=2))
    return 0 if all(doc["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
