"""The text tokens stand for, written as the user wrote it.

Tokenizers write some characters across several tokens: a byte-level BPE (GPT-2, Llama 3, SmolLM2) spells every
byte with a character of its own alphabet (a space is Ġ, the four bytes of 😀 are "ðŁĺĢ", often split over two
tokens), a SentencePiece vocabulary with byte fallback writes a character it lacks as `<0xF0>` `<0x9F>` ... tokens.
One convention serves every place text is shown: a character is written once, at the token that completes it, and
the tokens before it (its first bytes) are "" (never U+FFFD), so that the texts joined are the decoded text and a
view that sums relevance per word, span or token counts those earlier tokens where that token counts.

`token_texts` finds the texts from the token strings alone (a saved result is loaded without its tokenizer);
`decoded_texts` asks a tokenizer that is at hand (a generation's), which knows its own decoding best.
"""
from __future__ import annotations

import codecs
import re
from typing import Any, Sequence


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a byte-level BPE's tokens (printable
    bytes as themselves, the others from U+0100 on: a space is Ġ, a newline Ċ, a tab ĉ)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    return {**{chr(byte): byte for byte in printable}, **{chr(256 + k): byte for k, byte in enumerate(others)}}


BYTE_ALPHABET = _byte_alphabet()
#: a byte-fallback token (SentencePiece): one byte of a character the vocabulary lacks
BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
#: a token shown as written, never decoded: a tokenizer's added or special token (`<|im_start|>`, `<s>`, `[CLS]`,
#: `<｜begin▁of▁sentence｜>`), byte-fallback tokens apart
WRITTEN = re.compile(r"^(<[^\s<>]+>|\[[^\s\[\]]+\])$")
#: the byte-level alphabet's space and newline: a row holding them is byte-level BPE
SPACE_MARKERS = ("\u0120", "\u010a")


def token_texts(tokens: Sequence[str]) -> list[str]:
    """The text each of a sequence's tokens stands for, from the token strings: a byte-level BPE row's pieces as the
    bytes they spell, byte-fallback tokens as their byte, SentencePiece's ▁ as a space, special tokens and anything
    else as written (WordPiece's `##` stays for `words` to join). Bytes are gathered across consecutive tokens until
    they end on a whole character, which is written at the token that completes it, the earlier ones "". A token
    that is "" already (a text so made) waits in the same way; a character left unfinished (at the end, before a
    special token, or cut short by a token that does not continue it) is U+FFFD at its last token, so that no
    token's relevance is left without text."""
    byte_level = _byte_level(tokens)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    texts: list[str] = []
    decoded = ""  # text of the tokens since the last one that ended on a whole character
    waiting = False

    def close() -> None:
        nonlocal decoded, waiting
        if waiting:
            texts[-1] = decoded + decoder.decode(b"", final=True) or "\ufffd"
        decoder.reset()
        decoded, waiting = "", False

    for token in tokens:
        if WRITTEN.match(token) and not BYTE_TOKEN.match(token):
            close()
            texts.append(token)
            continue
        data = _token_bytes(token, byte_level)
        if decoder.getstate()[0] and data and not 0x80 <= data[0] < 0xC0:
            close()  # a character cut short (a token of it left out): U+FFFD at its last token, not at this one
        decoded += decoder.decode(data)
        waiting = not token or bool(decoder.getstate()[0])
        texts.append("" if waiting else decoded)
        if not waiting:
            decoded = ""
    close()
    return texts


def _token_bytes(token: str, byte_level: bool) -> bytes:
    """The bytes a token spells: a byte-fallback token's byte, a byte-level piece's through the alphabet, else its
    text (▁ a space) in UTF-8."""
    fallback = BYTE_TOKEN.match(token)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    if byte_level:
        return bytes(BYTE_ALPHABET[c] for c in token)
    return token.replace("\u2581", " ").encode("utf-8", "surrogatepass")


def _byte_level(tokens: Sequence[str]) -> bool:
    """Whether a row's tokens are byte-level BPE pieces: every one (special and byte-fallback tokens apart) written in
    the byte alphabet, and the row holds its space or newline or its bytes are UTF-8. So WordPiece or decoded tokens that happen to use the alphabet ("café": é is a byte of it) stay text."""
    pieces = [t for t in tokens if not WRITTEN.match(t)]
    if not all(c in BYTE_ALPHABET for t in pieces for c in t):
        return False
    if any(marker in t for t in pieces for marker in SPACE_MARKERS):
        return True
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    try:
        for t in pieces:
            decoder.decode(bytes(BYTE_ALPHABET[c] for c in t))
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


def decoded_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's text as the tokenizer decodes it, in the convention of `token_texts`: tokens are decoded together
    until their text ends in a whole character (a token that ends in one decodes alone). Joined, the texts are the
    decoded sequence."""
    texts: list[str] = []
    start = 0
    for end in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[start:end])
        if text.endswith("\ufffd") and end < len(ids):  # bytes of a character still to come
            texts.append("")
            continue
        texts.append(text)
        start = end
    return texts
