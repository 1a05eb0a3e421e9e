"""Character-level tokenizer, saved as a Hugging Face tokenizer directory.

The embedded tasks need no download, so fuseflow builds its own tokenizer with the
`tokenizers` library: one token per printable ASCII character plus four specials.
It round-trips through ``transformers.AutoTokenizer.from_pretrained``; a user's own
HF tokenizer directory works in its place (``model.tokenizer=DIR``).
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


def load_tokenizer(path: str | Path | None) -> PreTrainedTokenizerFast:
    """The user's HF tokenizer directory, or the built-in char tokenizer when ``path`` is None.

    A tokenizer without a pad token gets its eos token as pad, as HF trainers do.
    """
    if path is None:
        return build_char_tokenizer()
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"model.tokenizer: {path} is not a directory; pass a Hugging Face tokenizer directory")
    tok = AutoTokenizer.from_pretrained(str(p))
    if tok.eos_token_id is None:
        raise ValueError(f"model.tokenizer: {path} has no eos token; RL needs one to end responses")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
