"""What today's OpenAI clients send to /v1/chat/completions and what GuideLLM sends to every stream
(issue 32): the `developer` role renders as `system`, `tool` messages and a message's `name` reach
the chat template (a template that drops tool messages gets a 400 naming it, not a prompt missing the
tool's answer), and `stream_options.continuous_usage_stats` puts the usage so far on every chunk.
The completions are the offline engine's greedy ones for the prompt the template renders."""

from __future__ import annotations

import asyncio
import shutil

import jinja2
import openai
import pytest
import torch
from asgi_openai import client, words
from engine_helpers import make_pair

from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM
from target_service.serving.api import ServerHolder, create_app
from target_service.serving.replica import Replica
from target_service.serving.serve_args import ServeArgs

SETTINGS = dict(device="cpu", dtype="float32", kv_cache_memory="4MiB", max_model_len=160, max_num_seqs=4)
# every role, and a name where one is given (Qwen's layout)
RENDERS_ALL = ("{% for m in messages %}<{{ m['role'] }}{% if 'name' in m %} {{ m['name'] }}{% endif %}> "
               "{{ m['content'] }} {% endfor %}<assistant>")
# a template that knows three roles and skips the rest
SKIPS_TOOLS = ("{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant'] %}"
               "<{{ m['role'] }}> {{ m['content'] }} {% endif %}{% endfor %}<assistant>")


def _replica(target) -> tuple[Replica, object]:
    args = ServeArgs(target=str(target), drafter="none", admin_port=None, served_model_name="target",
                     **SETTINGS)
    replica = Replica(args)
    holder = ServerHolder()
    holder.install(replica.server)
    return replica, create_app(holder)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target, _ = make_pair(root, tokenizer=True)
    (target / "chat_template.jinja").write_text(RENDERS_ALL)
    skipping = shutil.copytree(target, root / "target-skipping-tools")
    (skipping / "chat_template.jinja").write_text(SKIPS_TOOLS)
    replicas = [_replica(target), _replica(skipping)]
    offline = LLM(str(target), "none", **SETTINGS)
    yield replicas[0][1], replicas[1][1], offline
    offline.close()
    for replica, _ in replicas:
        replica.close()


def offline_greedy(offline: LLM, messages: list[dict], max_tokens: int) -> str:
    """The offline engine's greedy text for the prompt RENDERS_ALL makes of `messages`, rendered here."""
    text = jinja2.Template(RENDERS_ALL).render(messages=messages)
    ids = offline.tokenizer.encode(text, add_special_tokens=False).ids
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return offline.generate([ids], params)[0].outputs[0].text


def chat(app, messages, **extra):
    async def ask():
        return await client(app).chat.completions.create(model="target", messages=messages, temperature=0,
                                                         max_tokens=8, extra_body={"ignore_eos": True},
                                                         **extra)
    return asyncio.run(ask())


def test_developer_is_system_and_tool_messages_and_names_reach_the_template(served):
    app, _, offline = served
    question, answer, result = words(5), words(4), words(3)
    developer = [{"role": "developer", "content": question}, {"role": "user", "content": answer}]
    as_system = [{"role": "system", "content": question}, {"role": "user", "content": answer}]
    assert chat(app, developer).choices[0].message.content == offline_greedy(offline, as_system, 8)
    with_tool = [{"role": "user", "content": question, "name": "ana"},
                 {"role": "assistant", "content": answer},
                 {"role": "tool", "content": result, "tool_call_id": "call-1"}]
    reply = chat(app, with_tool)
    assert reply.choices[0].message.content == offline_greedy(offline, with_tool, 8)
    nameless = [{key: value for key, value in m.items() if key != "name"} for m in with_tool]
    name_tokens = len(offline.tokenizer.encode(" ana", add_special_tokens=False).ids)
    assert name_tokens >= 1  # the name was rendered: the prompt is longer by exactly its tokens
    assert reply.usage.prompt_tokens == chat(app, nameless).usage.prompt_tokens + name_tokens


def test_a_template_that_drops_tool_messages_is_a_400_naming_it(served):
    _, skipping, _ = served
    messages = [{"role": "user", "content": words(4)}, {"role": "tool", "content": words(3)}]
    with pytest.raises(openai.BadRequestError) as refused:
        chat(skipping, messages)
    error = refused.value.body
    assert error["param"] == "messages" and "does not render tool messages" in error["message"], error
    ok = chat(skipping, [{"role": "developer", "content": words(3)}, {"role": "user", "content": words(3)}])
    assert ok.choices[0].finish_reason == "length"  # the same template takes the other roles


@pytest.mark.parametrize("continuous", [True, False])
def test_continuous_usage_puts_the_usage_so_far_on_every_chunk(served, continuous):
    app, _, offline = served
    messages = [{"role": "user", "content": words(6)}]
    max_tokens = int(torch.randint(4, 12, ()).item())

    async def stream():
        chunks = await client(app).chat.completions.create(
            model="target", messages=messages, temperature=0, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": continuous},
            extra_body={"ignore_eos": True})
        return [chunk async for chunk in chunks]

    chunks = asyncio.run(stream())
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == max_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == offline_greedy(offline, messages, max_tokens)
    carried = [c for c in chunks[:-1] if c.choices and c.choices[0].delta.content]
    if not continuous:
        assert all(c.usage is None for c in chunks[:-1])
        return
    counts = [c.usage.completion_tokens for c in carried]
    assert counts == sorted(counts) and counts[-1] == max_tokens and counts[0] >= 1
    assert {c.usage.prompt_tokens for c in carried} == {final.usage.prompt_tokens}
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in carried)
