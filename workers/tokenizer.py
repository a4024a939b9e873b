"""The tokenizer a worker needs, read from tokenizer.json without importing transformers (~1 s of its start).

It serves the calls the engine makes (text or chat messages in, ids out; ids back to text) for the
tokenizers transformers itself builds as the very same `tokenizers` model, unchanged (`_plain_settings`,
`_plain_backend`): tokenizer_config.json names transformers' tokenizers-backed class, every named special token is already a
token, and no option makes transformers rewrite the model (BOS/EOS flags, split special tokens, clean-up
of spaces, the Mistral regex patch of large vocabularies). Chat templates render in the same sandboxed
Jinja environment as transformers' (utils/chat_template_utils.py, transformers 5.24), with the same
variables. Every other tokenizer is transformers' own (workers/models.py). tests/test_tokenizer.py checks
ids, text and templates against transformers.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as Backend

SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REWRITING = ("add_bos_token", "add_eos_token", "auto_map", "fix_mistral_regex")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_MISTRAL_PATCH_VOCAB = 100_000  # transformers may patch the pre-tokenizer of larger vocabularies
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' assistant-mask extension, not ours


def read_settings(folder: Path) -> dict:
    """tokenizer_config.json, empty where there is none."""
    path = folder / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _content(token: str | dict) -> str:
    """A special token as tokenizer_config.json stores it: a string, or a serialised AddedToken."""
    return token["content"] if isinstance(token, dict) else token


def _template(folder: Path, settings: dict) -> str | None:
    path = folder / "chat_template.jinja"
    return path.read_text() if path.is_file() else settings.get("chat_template")


def _plain_settings(folder: Path, settings: dict) -> bool:
    """What tokenizer_config.json and the folder say: no option that makes transformers rewrite the tokenizer, and
    a template we render as it does."""
    template = _template(folder, settings)
    return not (settings.get("tokenizer_class") != "TokenizersBackend" or any(key in settings for key in _REWRITING)
                or settings.get("split_special_tokens") or settings.get("extra_special_tokens")
                or settings.get("additional_special_tokens") or (folder / "special_tokens_map.json").is_file()
                or not (folder / "tokenizer.json").is_file()
                or not isinstance(template, (str, type(None))) or (template and _GENERATION_TAG.search(template)))


def _plain_backend(settings: dict, backend: Backend) -> bool:
    """What tokenizer.json says: every named special token is a token, the vocabulary is small enough to escape
    transformers' regex patch, and clean-up of spaces is off or ignored (BPE)."""
    specials_known = all(backend.token_to_id(_content(settings[name])) is not None
                         for name in SPECIAL if settings.get(name) is not None)
    clean_up = settings.get("clean_up_tokenization_spaces", False)
    bpe = type(backend.model).__name__ == "BPE"
    return specials_known and backend.get_vocab_size() <= _MISTRAL_PATCH_VOCAB and (not clean_up or bpe) and not (
        clean_up and settings.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"))


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace without underscore-prefixed attributes (no reaching CPython internals), as transformers'."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore-prefixed attributes ({name!r})")


class _Dict:
    """`dict` for templates without attribute access to the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_Dict(), namespace=_Namespace)
    return env.from_string(template)


def _message(message: dict) -> dict:
    """A message as transformers hands it to the template: None-valued keys dropped, reasoning under all its names."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


class Tokenizer:
    """tokenizer.json with the calls the engine makes, named and behaving as transformers' tokenizer's."""

    def __init__(self, folder: Path, config: dict, backend: Backend):
        self.backend = backend
        self.backend.no_truncation()
        self.backend.no_padding()
        self.special_tokens_map = {name: _content(config[name]) for name in SPECIAL if config.get(name) is not None}
        self.chat_template = _template(folder, config)
        self.eos_token_id, self.pad_token_id = (self._id("eos_token"), self._id("pad_token"))

    @classmethod
    def load(cls, folder: Path) -> Tokenizer | None:
        """The tokenizer at `folder` where it is plain (see the module's docstring), else None."""
        config = read_settings(folder)
        if not _plain_settings(folder, config):
            return None
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        return cls(folder, config, backend) if _plain_backend(config, backend) else None

    def _id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @cached_property
    def _compiled(self) -> jinja2.Template:
        return _compile(self.chat_template)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.backend.encode(text, add_special_tokens=add_special_tokens).ids}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = True) -> str | list[int] | dict[str, list[int]]:
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        text = self._compiled.render(messages=[_message(m) for m in messages], tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special_tokens_map)
        if not tokenize:
            return text
        encoded = self(text, add_special_tokens=False)
        return encoded if return_dict else encoded["input_ids"]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)
