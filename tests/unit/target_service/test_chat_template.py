"""Chat templates render as transformers renders them: by hand, and against `apply_chat_template`."""

import json
import shutil

import pytest

from target_service.assembly.demo import demo_target_path
from target_service.serving.chat_template import ChatTemplateError, NoChatTemplate, load_chat_template

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort xs."}]

# Whitespace as HF templates write it: the newline after each block tag is dropped (trim_blocks) and
# the indentation before one is stripped (lstrip_blocks); `-` trims by hand.
BRACKETS = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'system' %}
<<{{ message['content'] }}>>
    {% else %}
[{{ message['role'] }}] {{ message['content'] }}{{ eos_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
[assistant]
{%- endif %}"""

# A realistic template: a namespace, loop controls, tojson, a system message hoisted out of the loop,
# raise_exception on a bad turn order, transformers' {% generation %} tag.
REALISTIC = """{%- set ns = namespace(system='') -%}
{%- if messages[0]['role'] == 'system' -%}
    {%- set ns.system = messages[0]['content'] -%}
{%- endif -%}
{{ bos_token }}{{ '<<SYS>>' + ns.system | tojson + '<</SYS>>\\n' if ns.system }}
{%- for message in messages if message['role'] != 'system' -%}
    {%- if (message['role'] == 'user') != loop.index0 is even -%}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif -%}
    {%- if message['role'] == 'user' -%}
        {{ '[INST] ' + message['content'] | trim + ' [/INST]' }}
    {%- else -%}
        {% generation %}{{ ' ' + message['content'] | trim + eos_token }}{% endgeneration %}
    {%- endif -%}
    {%- if loop.index > 8 %}{% break %}{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %} {% endif -%}"""


def checkpoint(tmp_path, template=None, jinja_file=None, **tokens) -> str:
    """A checkpoint directory holding the demo tokenizer and the given template(s)."""
    shutil.copy(demo_target_path() / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokens}
    if template is not None:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja_file is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja_file)
    return str(tmp_path)


def test_a_two_message_chat_renders_to_the_hand_computed_prompt(tmp_path):
    template = load_chat_template(checkpoint(tmp_path, BRACKETS, bos_token="<s>", eos_token="</s>"))
    assert template.render(CHAT) == "<s>\n<<Be brief.>>\n[user] Sort xs.</s>\n[assistant]"
    assert template.render(CHAT, add_generation_prompt=False) == "<s>\n<<Be brief.>>\n[user] Sort xs.</s>\n"


def test_special_tokens_as_added_token_dicts_and_absent_ones_render_as_hf_does(tmp_path):
    directory = checkpoint(tmp_path, BRACKETS, bos_token={"__type": "AddedToken", "content": "<s>"})
    assert load_chat_template(directory).render(CHAT[1:]) == "<s>\n[user] Sort xs.\n[assistant]"


def test_the_jinja_file_wins_over_tokenizer_config(tmp_path):
    directory = checkpoint(tmp_path, "config", jinja_file="{{ messages[0]['content'] }} from the file")
    assert load_chat_template(directory).render(CHAT) == "Be brief. from the file"


def test_named_templates_use_the_default(tmp_path):
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    assert load_chat_template(checkpoint(tmp_path, named)).render(CHAT) == "plain"


def test_the_demo_target_renders_chatml():
    template = load_chat_template(demo_target_path())
    assert template.render(CHAT) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                     "<|im_start|>user\nSort xs.<|im_end|>\n<|im_start|>assistant\n")
    # the demo tokenizer (byte-level BPE) encodes the prompt losslessly
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(demo_target_path() / "tokenizer.json"))
    prompt = template.render(CHAT)
    assert tokenizer.decode(tokenizer.encode(prompt, add_special_tokens=False).ids) == prompt


@pytest.mark.parametrize("name", ["brackets", "realistic", "demo"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_we_render_what_transformers_apply_chat_template_renders(tmp_path, name, add_generation_prompt):
    transformers = pytest.importorskip("transformers")
    chat = [*CHAT, {"role": "assistant", "content": " sorted(xs) "}, {"role": "user", "content": "Thanks"}]
    if name == "demo":
        directory = str(demo_target_path())
    else:
        source = BRACKETS if name == "brackets" else REALISTIC
        directory = checkpoint(tmp_path, source, bos_token="<s>", eos_token="</s>")
    theirs = transformers.AutoTokenizer.from_pretrained(directory).apply_chat_template(
        chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    ours = load_chat_template(directory).render(chat, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    if name == "realistic":
        assert ours.startswith('<s><<SYS>>"Be brief."<</SYS>>\n[INST] Sort xs. [/INST] sorted(xs)</s>')


def test_a_checkpoint_without_a_template_points_at_completions(tmp_path):
    with pytest.raises(NoChatTemplate) as caught:
        load_chat_template(checkpoint(tmp_path))
    assert str(caught.value) == (f"{tmp_path.name}: no chat template (tokenizer_config.json has no "
                                 "chat_template); use /v1/completions")
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(NoChatTemplate, match=r"\(no tokenizer_config.json\); use /v1/completions"):
        load_chat_template(tmp_path)
    assert isinstance(caught.value, ValueError)  # the HTTP layer answers ValueError with a 400


def test_raise_exception_in_a_template_is_a_one_line_error_with_its_message(tmp_path):
    template = load_chat_template(checkpoint(tmp_path, REALISTIC, bos_token="<s>", eos_token="</s>"))
    with pytest.raises(ChatTemplateError) as caught:
        template.render([{"role": "assistant", "content": "I speak first"}])
    assert str(caught.value) == ("the chat template refused the messages: Conversation roles must alternate "
                                 "user/assistant/user/assistant/...")


def test_a_template_that_fails_to_render_or_compile_is_one_line_naming_the_problem(tmp_path):
    (tmp_path / "a").mkdir()
    template = load_chat_template(checkpoint(tmp_path / "a", "{{ messages[5]['content'] }}"))
    with pytest.raises(ChatTemplateError, match=r"^a: the chat template failed to render \(UndefinedError: "):
        template.render(CHAT)
    (tmp_path / "b").mkdir()
    with pytest.raises(ChatTemplateError) as caught:
        load_chat_template(checkpoint(tmp_path / "b", "{% for m in messages %}\n{{ m }"))
    assert str(caught.value).startswith("b: the chat template does not compile: ")
    assert "(line 2)" in str(caught.value) and "\n" not in str(caught.value)


def test_a_template_cannot_reach_python_internals(tmp_path):
    template = load_chat_template(checkpoint(tmp_path, "{{ messages.__class__.__mro__ }}"))
    with pytest.raises(ChatTemplateError, match="SecurityError: access to attribute '__class__'"):
        template.render(CHAT)
    (tmp_path / "c").mkdir()
    mutating = load_chat_template(checkpoint(tmp_path / "c", "{{ messages.append(1) }}"))
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        mutating.render(CHAT)


def test_the_compiled_template_is_cached_per_directory(tmp_path):
    directory = checkpoint(tmp_path, BRACKETS)
    first = load_chat_template(directory)
    assert load_chat_template(tmp_path / "." / "") is first
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "changed"}))
    assert load_chat_template(directory) is first  # compiled once: a later edit is not seen
