"""The openai client over an app served in this process (httpx's ASGI transport: no socket), and
random prompt words of the tiny pair's word-level vocabulary, for the HTTP tests."""

from __future__ import annotations

import httpx
import openai
import torch


def client(app) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=app)
    return openai.AsyncOpenAI(base_url="http://dflash.test/v1", api_key="none", max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport, base_url="http://dflash.test"))


def words(count: int) -> str:
    return " ".join(f"w{i}" for i in torch.randint(3, 160, (count,)).tolist())
