"""Tokenizers: fuseflow's character-level one, a user's Hugging Face one, and chat templates.

The embedded tasks need no download, so fuseflow builds its own tokenizer with the
`tokenizers` library: one token per printable ASCII character plus four specials.
It round-trips through ``transformers.AutoTokenizer.from_pretrained``; a user's own
HF tokenizer directory works in its place (``model.tokenizer=DIR``).

A chat model's prompts go through its chat template (``task.chat_template``, on by
default when the tokenizer has one): the task's prompt becomes one user turn followed by
the assistant header, and generation stops at the template's end-of-turn token (ChatML's
``<|im_end|>``, Llama 3's ``<|eot_id|>``) as well as at eos. ``load_tokenizer`` records
both on the tokenizer it returns, so every place that encodes prompts or stops
generation (training, held-out evaluation, SFT) reads them from the one object.
"""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
ALPHABET = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"] + ["\n"]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A char-level tokenizer: ids 0-3 are <pad>, <bos>, <eos>, <unk>; then the alphabet."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + ALPHABET)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Split every character into its own piece; Fuse joins them back without spaces.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


# Attributes load_tokenizer sets on the tokenizer it returns (plain attributes: they survive pickling
# to Ray workers, and a tokenizer built elsewhere without them means "no chat template, stop at eos").
CHAT_ATTR = "fuseflow_chat_template"
STOP_ATTR = "fuseflow_stop_ids"


def load_tokenizer(path: str | Path | None, chat_template: bool | None = None) -> PreTrainedTokenizerFast:
    """The user's HF tokenizer directory, or the built-in char tokenizer when ``path`` is None.

    ``chat_template``: True formats prompts with the tokenizer's chat template (an error when it
    has none), False never does, None does when the tokenizer has one. A tokenizer without a pad
    token gets its eos token as pad, as HF trainers do.
    """
    if path is None:
        tok = build_char_tokenizer()
    else:
        p = Path(path).expanduser()
        if not p.is_dir():
            raise FileNotFoundError(f"model.tokenizer: {path} is not a directory; pass a Hugging Face tokenizer "
                                    "directory")
        tok = AutoTokenizer.from_pretrained(str(p))
        if tok.eos_token_id is None:
            raise ValueError(f"model.tokenizer: {path} has no eos token; RL needs one to end responses")
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
    return with_chat_template(tok, chat_template, path)


def with_chat_template(tok, chat_template: bool | None, source: str | Path | None = None):
    """``tok`` with its chat-template choice and stop tokens recorded (see ``load_tokenizer``)."""
    has = bool(getattr(tok, "chat_template", None))
    if chat_template and not has:
        where = f"the tokenizer in {source}" if source else "fuseflow's char tokenizer"
        raise ValueError(f"task.chat_template=true, but {where} has no chat template; set "
                         "task.chat_template=false or use a chat model's tokenizer")
    use = has if chat_template is None else chat_template
    setattr(tok, CHAT_ATTR, use)
    eot = end_of_turn_id(tok) if use else None
    setattr(tok, STOP_ATTR, tuple(dict.fromkeys(i for i in (eot, tok.eos_token_id) if i is not None)))
    return tok


def uses_chat_template(tok) -> bool:
    """Whether prompts for ``tok`` go through its chat template."""
    return bool(getattr(tok, CHAT_ATTR, False))


def prompt_text(tok, text: str) -> str:
    """The text the model sees for a task prompt: one user turn plus the assistant header, or ``text`` itself.

    >>> prompt_text(build_char_tokenizer(), "1+1=")
    '1+1='
    """
    if not uses_chat_template(tok):
        return text
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def stop_token_ids(tok) -> tuple[int, ...]:
    """Token ids that end a response: the chat template's end-of-turn token (when used), then eos."""
    return getattr(tok, STOP_ATTR, None) or (tok.eos_token_id,)


def end_of_turn_id(tok) -> int | None:
    """The special token the chat template puts right after an assistant message (None if there is none).

    Found by rendering a short conversation rather than from a list of known names, so any
    template (ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``, ...) is handled alike.
    """
    mark = "fuseflow-end-of-turn-probe"
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": mark}],
                                       tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render this conversation has no usable end marker
        return None
    at = text.rfind(mark)
    if at < 0:
        return None
    after = tok(text[at + len(mark):], add_special_tokens=False)["input_ids"]
    special = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}) or {})
    return after[0] if after and after[0] in special else None
