"""Tokenizer: a `tokenizers` byte-level BPE plus the model's chat template and stop tokens.

Built from GGUF metadata (tokens, merges, token types, special ids, chat template) or from a
Hugging Face directory (tokenizer.json, tokenizer_config.json, generation_config.json). The chat
template is rendered with Jinja2 the way transformers renders it (sandboxed, trim/lstrip blocks).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from replica.errors import InvalidRequestError, ModelFormatError

ROLES = ("system", "user", "assistant", "tool")
# Tokens that close a chat turn; a special token among these that the template writes stops decoding.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
CONTROL, USER_DEFINED = 3, 4  # GGUF tokenizer.ggml.token_type values

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) → the split that runs before byte-level.
# "smollm" (like starcoder) isolates every digit first, as SmolLM's own tokenizer.json does.
_DIGIT_SPLIT_PRES = ("smollm", "starcoder", "refact", "codeshell")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_REGEX_PRES = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT}


class Tokenizer:
    """Text ↔ token ids, chat template rendering, and the ids that end generation."""

    def __init__(self, backend: Backend, *, chat_template: str | None, bos_token_id: int | None,
                 eos_token_ids: tuple[int, ...], template_tokens: Mapping[str, str]) -> None:
        self._backend = backend
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self._template_tokens = dict(template_tokens)  # bos_token/eos_token/... seen by the template
        self._template = _compile_template(chat_template) if chat_template else None

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, fields: Mapping[str, Any]) -> "Tokenizer":
        """From GGUF metadata as plain values (gguf_file.read_gguf(path).fields): a byte-level BPE
        ("gpt2" model)."""

        def meta(key: str, default: Any = None) -> Any:
            return fields.get(key, default)

        model = meta("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelFormatError(f"unsupported GGUF tokenizer model {model!r}; only byte-level BPE "
                                   "('gpt2') is supported")
        tokens, merges = meta("tokenizer.ggml.tokens"), meta("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise ModelFormatError("GGUF tokenizer metadata lacks tokenizer.ggml.tokens/merges")
        types = meta("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend = _byte_level_bpe(tokens, merges, types, meta("tokenizer.ggml.pre", "default"))
        bos, eos = meta("tokenizer.ggml.bos_token_id"), meta("tokenizer.ggml.eos_token_id")
        if meta("tokenizer.ggml.add_bos_token", False) and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], bos)])
        names = {"bos_token": bos, "eos_token": eos,
                 "unk_token": meta("tokenizer.ggml.unknown_token_id"),
                 "pad_token": meta("tokenizer.ggml.padding_token_id")}
        specials = {tokens[i]: i for i, t in enumerate(types) if t == CONTROL}
        template = meta("tokenizer.chat_template")
        return cls(backend, chat_template=template, bos_token_id=bos,
                   eos_token_ids=_stop_ids([eos], specials, template),
                   template_tokens={k: tokens[v] for k, v in names.items() if v is not None})

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """From a Hugging Face directory: tokenizer.json (+ tokenizer_config.json, generation_config.json)."""
        path = Path(path)
        try:
            backend = Backend.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the Rust error is a bare message; name the file
            raise ModelFormatError(f"{path / 'tokenizer.json'}: cannot read tokenizer ({e})") from e
        config = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        names = {k: _token_content(config.get(k))
                 for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        template = config.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        elif isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        to_id = lambda tok: None if tok is None else backend.token_to_id(tok)  # noqa: E731
        gen_eos = gen.get("eos_token_id")
        eos = [to_id(names["eos_token"])] + (gen_eos if isinstance(gen_eos, list) else [gen_eos])
        specials = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        return cls(backend, chat_template=template, bos_token_id=to_id(names["bos_token"]),
                   eos_token_ids=_stop_ids(eos, specials, template),
                   template_tokens={k: v for k, v in names.items() if v is not None})

    # ---- text <-> ids -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """Id of one token string (as spelled in the vocabulary), or None."""
        return self._backend.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in it (<|im_start|>) map to their ids.

        A BOS is added only where the model's metadata asks for one (its post-processor).
        """
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a string, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 sequences decode to U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat -----------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render a conversation to the prompt text the model was trained on."""
        validate_messages(messages)
        if self._template is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead",
                                      param="messages")
        try:
            return self._template.render(messages=[dict(m) for m in messages], tools=None,
                                         documents=None, add_generation_prompt=add_generation_prompt,
                                         **self._template_tokens)
        except jinja2.TemplateError as e:  # raise_exception() in the template: the request is wrong
            raise InvalidRequestError(f"chat template rejected the conversation: {e}",
                                      param="messages") from e


# ---- helpers ----------------------------------------------------------------------------------
def _byte_level_bpe(tokens: list[str], merges: list[str], types: list[int], pre: str) -> Backend:
    """GPT-2 style BPE over the byte alphabet; control tokens become special added tokens."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token not written in the byte alphabet (rare, a converter quirk) is respelled into it.
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Backend(BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                          end_of_word_suffix="", fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRES:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _REGEX_PRES:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_PRES[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if pre == "qwen2":
            backend.normalizer = normalizers.NFC()
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    # Tokens outside the byte alphabet marked control are converter mislabels: not added.
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, ty in zip(tokens, types) if ty == CONTROL and set(t) <= alphabet])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return backend


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b), cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _stop_ids(eos: list[int | None], specials: Mapping[str, int], template: str | None) -> tuple[int, ...]:
    """EOS ids, plus any special end-of-turn token the chat template writes; deduplicated, in order."""
    ids = [i for i in eos if i is not None]
    ids += [specials[t] for t in END_OF_TURN if t in specials and template and t in template]
    return tuple(dict.fromkeys(ids))


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from e


def _token_content(tok: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    return tok.get("content") if isinstance(tok, dict) else tok


def validate_messages(messages: Any) -> None:
    """Raise InvalidRequestError unless messages is a non-empty list of {role, content: str} dicts."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects",
                                  param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object, got {type(m).__name__}",
                                      param="messages")
        if m.get("role") not in ROLES:
            raise InvalidRequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}; "
                                      f"got {m.get('role')!r}", param="messages")
        if not isinstance(m.get("content"), str):
            raise InvalidRequestError(f"messages[{i}].content must be a string, got "
                                      f"{type(m.get('content')).__name__}", param="messages")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): render the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in transformers' environment (sandboxed, trim/lstrip blocks)."""
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelFormatError(f"chat template does not compile: {e}") from e
