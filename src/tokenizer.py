"""Tokenizer (via the `tokenizers` library) and chat template rendering with response masks."""
from __future__ import annotations

import json
import warnings
from datetime import datetime
from pathlib import Path

import jinja2.ext
from jinja2.exceptions import TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from .errors import DataError, ModelError
from .fileio import write_json, write_text
from .gguf_tokenizer import gguf_backend

# End-of-turn tokens that stop generation when the chat template uses them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>",
                      "<end_of_turn>", "<|end|>", "<|eom_id|>")
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


class Tokenizer:
    """Text <-> token ids, special tokens, and the model's chat template."""

    def __init__(self, backend, *, bos_token=None, eos_token=None, pad_token=None,
                 add_bos_token=False, add_eos_token=False, chat_template=None,
                 source="tokenizer", template_source=None):
        self._tok = backend  # tokenizers.Tokenizer
        self.source = source
        self.template_source = template_source or source  # where the template came from
        self.add_bos_token = bool(add_bos_token)
        self.add_eos_token = bool(add_eos_token)
        self.chat_template = chat_template
        self.has_chat_template = chat_template is not None
        self.bos_token_id = self._id_or_none(bos_token, "bos_token")
        self.eos_token_id = self._id_or_none(eos_token, "eos_token")
        if self.eos_token_id is None:
            self.eos_token_id = next((self.token_to_id(t) for t in END_OF_TURN_TOKENS
                                      if self.token_to_id(t) is not None), None)
        if self.eos_token_id is None:
            raise ModelError(f"{source}: the tokenizer has no end-of-sequence token")
        pad = self._id_or_none(pad_token, "pad_token")
        self.pad_token_id = self.eos_token_id if pad is None else pad
        self._stop_ids = set()  # generation_config.json's
        self._template_ids = self._template_end_ids()
        self._compiled = None

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_file(cls, path, tokenizer_config: dict | None = None,
                  template_source: str | None = None) -> Tokenizer:
        """A Hugging Face tokenizer.json plus its tokenizer_config.json dict (its chat template
        from `template_source` when not tokenizer_config.json, for the template's errors)."""
        path = Path(path)
        if not path.is_file():
            raise ModelError(f"{path}: tokenizer file not found")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - any failure means a bad file
            raise ModelError(f"{path}: cannot read the tokenizer: {e}") from None
        cfg = tokenizer_config or {}
        cfg_path = path.with_name("tokenizer_config.json")
        bos, eos, pad = (_token_text(cfg.get(k), k, cfg_path)
                         for k in ("bos_token", "eos_token", "pad_token"))
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # decided by the tokenizer.json post-processor
            bos_id = backend.token_to_id(bos) if bos else None
            ids = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and bool(ids) and ids[0] == bos_id
        return cls(backend, bos_token=bos, eos_token=eos, pad_token=pad, add_bos_token=add_bos,
                   add_eos_token=bool(cfg.get("add_eos_token", False)),
                   chat_template=chat_template_text(cfg.get("chat_template"), cfg_path),
                   source=str(path), template_source=template_source)

    @classmethod
    def from_gguf(cls, fields: dict, source: str = "model.gguf") -> Tokenizer:
        """The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata: byte-level
        BPE ("gpt2") or SentencePiece ("llama"), see gguf_tokenizer.py."""
        backend, special = gguf_backend(fields, source)
        return cls(backend, **special, source=source)

    def save(self, folder) -> None:
        """Write tokenizer.json and tokenizer_config.json (Hugging Face layout) into `folder`."""
        folder = Path(folder)
        write_text(folder / "tokenizer.json", self._tok.to_str())
        tok = self.id_to_token
        cfg = {"bos_token": tok(self.bos_token_id) if self.bos_token_id is not None else None,
               "eos_token": tok(self.eos_token_id),
               "pad_token": tok(self.pad_token_id) if self.pad_token_id is not None else None,
               "add_bos_token": self.add_bos_token, "add_eos_token": self.add_eos_token,
               "chat_template": self.chat_template,
               "tokenizer_class": "PreTrainedTokenizerFast"}
        write_json(folder / "tokenizer_config.json", cfg)

    # ---- ids <-> text -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> dict:
        """The tokenizer.json contents (the `tokenizers` library's own serialisation)."""
        return json.loads(self._tok.to_str())

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        if add_special_tokens and self.add_eos_token:
            ids = ids + [self.eos_token_id]
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def set_chat_template(self, template: str, source: str | None = None) -> None:
        """Use `template` (jinja) as the chat template from now on (data.chat_template, an
        adapter's); its errors name `source` (default: the tokenizer's file)."""
        self.chat_template = template
        self.template_source = source or self.source
        self.has_chat_template = True
        self._template_ids = self._template_end_ids()
        self._compiled = None

    @property
    def eos_token_ids(self) -> set[int]:
        """The ids generation stops at: EOS, the end-of-turn tokens the current chat template
        writes, and those generation_config.json names."""
        return {self.eos_token_id} | self._template_ids | self._stop_ids

    def add_eos_ids(self, ids, source="generation_config.json") -> None:
        """Add stop ids (e.g. generation_config.json's eos_token_id: an id or a list of them)."""
        ids = [ids] if not isinstance(ids, list) else ids
        ids = [i for i in ids if i is not None]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ModelError(f"{source}: eos_token_id must be a token id or a list of them, "
                             f"got {ids!r}")
        self._stop_ids |= set(ids)

    @property
    def bos_token(self) -> str:
        return "" if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str:
        return self.id_to_token(self.eos_token_id)

    # ---- chat template ------------------------------------------------------------------
    def apply_chat_template(self, messages, add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs):
        """Render a conversation with the model's template (ChatML if it has none)."""
        _check_messages(messages, "messages")
        text = self._render(messages, add_generation_prompt, **kwargs)
        return self.encode(text) if tokenize else text

    def render_chat_with_masks(self, messages) -> list[tuple[str, bool]]:
        """The rendered conversation as (text, is_response) segments, in order."""
        text, spans = self._response_spans(messages)
        segments, pos = [], 0
        for start, end in spans:
            if start > pos:
                segments.append((text[pos:start], False))
            segments.append((text[start:end], True))
            pos = end
        if pos < len(text):
            segments.append((text[pos:], False))
        return segments

    def chat_token_masks(self, messages, untrained=()) -> tuple[list[int], list[bool]]:
        """Token ids of the rendered conversation and which of them belong to responses: the
        assistant messages, but those whose index is in `untrained`."""
        text, spans = self._response_spans(messages, untrained)
        enc = self._tok.encode(text, add_special_tokens=False)
        mask = [any(s < e_tok and s_tok < e for s, e in spans) for s_tok, e_tok in enc.offsets]
        return list(enc.ids), mask

    def _response_spans(self, messages, untrained=()) -> tuple[str, list[tuple[int, int]]]:
        """Character spans of each trained assistant content (+ its end-of-turn token) in the
        text."""
        _check_messages(messages, self.source)
        full = self._render(messages, add_generation_prompt=False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant" or i in untrained:
                continue
            before = self._render(messages[:i], add_generation_prompt=True) if i else ""
            upto = self._render(messages[: i + 1], add_generation_prompt=False)
            if not (upto.startswith(before) and full.startswith(upto)):
                raise DataError(f"{self.template_source}: the chat template does not render "
                                f"message {i} "
                                "(assistant) as an extension of the earlier messages, so the "
                                "response cannot be located for loss masking")
            spans.append(self._content_span(upto, len(before), message["content"]))
        return full, spans

    def _content_span(self, upto: str, base: int, content: str) -> tuple[int, int]:
        body = upto[base:]
        at = body.find(content) if content else -1
        if at < 0:  # the template changed the content: the whole turn is the response
            return base, base + len(body.rstrip())
        end = base + at + len(content)
        for tok_id in sorted(self.eos_token_ids):
            tok = self.id_to_token(tok_id)
            if tok and upto.startswith(tok, end):
                end += len(tok)
                break
        return base + at, end

    def _render(self, messages, add_generation_prompt: bool, **kwargs) -> str:
        template = self._template()
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
        except TemplateError as e:
            raise DataError(f"{self.template_source}: chat template failed: {e}") from None

    def _template(self):
        if self._compiled is None:
            env = _jinja_env()
            try:
                self._compiled = env.from_string(self.chat_template or DEFAULT_CHAT_TEMPLATE)
            except TemplateSyntaxError as e:
                raise ModelError(f"{self.template_source}: the chat template is not valid Jinja "
                                 f"(line {e.lineno}): {e.message}") from None
        return self._compiled

    # ---- helpers ------------------------------------------------------------------------
    def _id_or_none(self, token: str | None, key: str) -> int | None:
        """The id of the special token `key` names; one the vocabulary lacks is left out with a
        warning (transformers would add it as a token the model has no row for)."""
        if token is None:
            return None
        found = self.token_to_id(token)
        if found is None:
            warnings.warn(f"{self.source}: the {key} its configuration names, {token!r}, is not "
                          "in the vocabulary; left out", stacklevel=3)
        return found

    def _template_end_ids(self) -> set[int]:
        template = self.chat_template or DEFAULT_CHAT_TEMPLATE
        ids = {self.token_to_id(t) for t in END_OF_TURN_TOKENS if t in template}
        return {i for i in ids if i is not None}


def _token_text(value, key, path) -> str | None:
    """A special token of tokenizer_config.json: its text, or an AddedToken dict's content."""
    text = value.get("content") if isinstance(value, dict) else value
    if text is not None and not isinstance(text, str):
        raise ModelError(f"{path}: {key} must be the token's text, got {value!r}")
    return text


def read_chat_template(path, key: str | None = None, error=ModelError) -> str:
    """The text of a chat template file; unreadable or not UTF-8 is an `error` naming the file
    (after `key`, the setting that gave it)."""
    where = f"{key}: {path}" if key else str(path)
    try:
        return Path(path).read_text(encoding="utf-8")
    except IsADirectoryError:
        raise error(f"{where}: a folder, not a chat template file") from None
    except OSError as e:
        raise error(f"{where}: cannot read it: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text ({e.reason})") from None


def chat_template_text(value, path) -> str | None:
    """tokenizer_config's chat_template may be a string or a list of named templates, of which
    the one named "default" is used (as transformers uses it)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ModelError(f"{path}: chat_template lists named templates but none named "
                         f"'default' (names: {', '.join(map(str, named)) or 'none'})")
    raise ModelError(f"{path}: chat_template has an unsupported form ({type(value).__name__})")


def _check_messages(messages, source: str) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
            raise DataError(f"{source}: message {i} must be a dict with 'role' and string "
                            f"'content', got {m!r}")


def _jinja_env():
    """A sandboxed Jinja environment configured as Hugging Face renders chat templates."""

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
