"""The worker's tokenizer (workers/tokenizer.py) gives transformers' ids, text and chat renderings, and
declines every tokenizer transformers would change on loading."""
from __future__ import annotations

import json

import jinja2
import pytest
from transformers import AutoTokenizer

from tests.tiny_models import tiny_tokenizer
from workers.tokenizer import Tokenizer

SMOLLM2_TEMPLATE = (  # the demo model's own template
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou "
    "are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + "
    "message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")
# What real templates use beyond loops: namespaces, dict(), tojson, loop controls, the date, errors, special
# tokens by name, reasoning fields.
RICH_TEMPLATE = """{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}{% if m.role == 'system' %}
{% set ns.system = m.content %}{% continue %}{% endif %}
{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('unknown role ' + m.role) }}{% endif %}
<|im_start|>{{ m.role }} {{ dict(n=loop.index) | tojson }} {{ strftime_now('%Y') }}
{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content | trim }}{{ eos_token }}
{% endfor %}{% if ns.system %}[{{ ns.system }}]{% endif %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
TEXTS = ["The quick brown fox", "", "  spaces   and\ttabs\n\nnewlines ", "ünïcödé — 漢字 🙂", "<|im_end|> in text",
         "def add(a, b):\n    return a + b", "<|im_start|>user\nhello<|im_end|>"]
CHATS = [[{"role": "user", "content": "rewrite this sentence politely please"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi <|im_end|>"},
          {"role": "assistant", "content": " hello ", "reasoning": "greet back", "name": None},
          {"role": "user", "content": "ünïcödé 🙂"}]]


def saved(tmp_path, template: str | None = None, **settings):
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = template or tokenizer.chat_template
    folder = tmp_path / "tok"
    tokenizer.save_pretrained(folder)
    if settings:
        path = folder / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))
    return folder


@pytest.mark.parametrize("template", [None, SMOLLM2_TEMPLATE, RICH_TEMPLATE], ids=["tiny", "smollm2", "rich"])
def test_ids_text_and_chats_equal_transformers(template, tmp_path):
    folder = saved(tmp_path, template)
    ours, theirs = Tokenizer.load(folder), AutoTokenizer.from_pretrained(folder)
    assert ours is not None
    assert (ours.eos_token_id, ours.pad_token_id, ours.chat_template) == (theirs.eos_token_id, theirs.pad_token_id,
                                                                          theirs.chat_template)
    assert ours.get_vocab() == theirs.get_vocab()
    for text in TEXTS:
        for special in (True, False):
            ids = ours(text, add_special_tokens=special)["input_ids"]
            assert ids == theirs(text, add_special_tokens=special)["input_ids"]
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    for chat in CHATS:
        for prompt in (True, False):
            mine = ours.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=True, return_dict=True)
            assert mine["input_ids"] == theirs.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=True,
                                                                   return_dict=True)["input_ids"]
            assert (ours.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False)
                    == theirs.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False))


def test_template_errors_and_sandbox_match_transformers(tmp_path):
    ours = Tokenizer.load(saved(tmp_path, RICH_TEMPLATE))
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    escape = Tokenizer.load(saved(tmp_path / "b", "{% set ns = namespace() %}{% set ns._x = 1 %}{{ messages }}"))
    with pytest.raises(jinja2.exceptions.SecurityError):
        escape.apply_chat_template(CHATS[0])


@pytest.mark.parametrize("settings", [{"add_bos_token": True}, {"tokenizer_class": "LlamaTokenizer"},
                                      {"eos_token": "<not-a-token>"}, {"split_special_tokens": True},
                                      {"auto_map": {"AutoTokenizer": ["x.Tok", None]}}])
def test_tokenizers_transformers_would_change_are_declined(settings, tmp_path):
    assert Tokenizer.load(saved(tmp_path)) is not None
    assert Tokenizer.load(saved(tmp_path / "changed", **settings)) is None


def test_templates_with_transformers_own_tags_are_declined(tmp_path):
    template = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    assert Tokenizer.load(saved(tmp_path, template)) is None
