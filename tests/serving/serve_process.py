"""A real `dflash serve` in a subprocess (its own Ray on loopback), for the serving tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import openai
from free_ports import free_port

from kvpool_service.client import KVPoolClient

MODEL = dict(device="cpu", dtype="float32", kv_cache_memory="16MiB", max_model_len=512, max_num_seqs=4)
PROMPT = "def parse_args(argv):\n    parser = "
READY_TIMEOUT_S = 150


def offline_completion(max_tokens: int = 32):
    """The offline in-process LLM's greedy completion of PROMPT with MODEL's settings: the reference."""
    from target_service.engine.sampling_params import SamplingParams
    from target_service.llm import LLM

    llm = LLM(**MODEL)
    try:
        return llm.generate([PROMPT], SamplingParams(max_tokens=max_tokens, temperature=0))[0].outputs[0]
    finally:
        llm.close()


def assert_completion_and_stream_equal(api: openai.OpenAI, expected) -> None:
    """A whole completion of PROMPT and a streamed one both give the offline reference's text."""
    whole = api.completions.create(model="dflash-demo", prompt=PROMPT, max_tokens=32, temperature=0)
    assert whole.choices[0].text == expected.text
    assert whole.usage.completion_tokens == len(expected.token_ids)
    stream = api.completions.create(model="dflash-demo", prompt=PROMPT, max_tokens=32, temperature=0,
                                    stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected.text


class Server:
    """`dflash serve` with the demo pair (MODEL's settings) plus `extra` flags; ready once it prints
    its ready line."""

    def __init__(self, *extra: str, replicas: int = 2):
        self.port, self.admin_port = free_port(), free_port()
        while self.admin_port + 1 == self.port:
            self.admin_port = free_port()
        command = [sys.executable, "-m", "dflash_cli.main", "serve", "--port", str(self.port),
                   "--admin-port", str(self.admin_port), "--replicas", str(replicas),
                   "--num-cpus-per-replica", "0.5", "--device", "cpu", "--dtype", "float32",
                   "--kv-cache-memory", MODEL["kv_cache_memory"],
                   "--max-model-len", str(MODEL["max_model_len"]),
                   "--max-num-seqs", str(MODEL["max_num_seqs"]), *extra]
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=env)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self.ready.wait(READY_TIMEOUT_S):
            self.process.kill()
            raise AssertionError("dflash serve never became ready:\n" + "".join(self.lines[-30:]))
        self.url = f"http://127.0.0.1:{self.port}"

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)
            if line.startswith("dflash serve: ready at"):
                self.ready.set()

    def wait(self, timeout: float) -> int:
        """The exit status, once the process has ended and every line it printed is in `lines`."""
        status = self.process.wait(timeout)
        self._reader.join(timeout)
        return status

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM (the server drains), then kill what is still there after `timeout`."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def admin(self, rank: int) -> KVPoolClient:
        return KVPoolClient(f"127.0.0.1:{self.admin_port + rank}")
