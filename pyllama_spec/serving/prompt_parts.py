"""A request's prompt as the engine decodes it: its text (rendered by the chat template for
messages), its images, and its parts — int32 token arrays for text, media ``Chunk``s for images —
checked against one slot's share of the context before anything is decoded.

A prompt far over the context is refused by what it must cost at least, before tokenizing it
whole (see ``PromptParts.refuse_a_prompt_that_cannot_fit``).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from pyllama_spec.bindings.mtmd import MEDIA_MARKER, Bitmap
from pyllama_spec.errors import ContextOverflowError, ImageError
from pyllama_spec.serving.chat_template import ChatOptions, ChatParams
from pyllama_spec.serving.request import PromptInput
from pyllama_spec.speculative.media import pair_with_draft
from pyllama_spec.speculative.sequence import rows_of

# Counting a long prompt's tokens piece by piece before tokenizing it whole (see
# PromptParts.refuse_a_prompt_that_cannot_fit): above this many bytes per context row, in pieces of
# about this many characters, each piece allowed this many tokens more than the whole would have.
_COUNT_PIECES_ABOVE = 8
_COUNT_PIECE_CHARS = 64 * 1024
_COUNT_SLACK_PER_PIECE = 16
#: What ``PromptParts.tokenize`` says of a prompt with no token and no image.
EMPTY_PROMPT = "the prompt is empty"


class PromptParts:
    """Turns a request's ``PromptInput`` into the parts a generation decodes, for one engine: its
    model, projector(s), chat templates and context (``n_ctx``, shared by ``n_parallel`` slots)."""

    def __init__(self, model, projector, draft_projector, chat, ctx, n_parallel: int) -> None:
        self.model, self.projector, self.draft_projector = model, projector, draft_projector
        self.chat, self.ctx, self.n_parallel = chat, ctx, n_parallel

    # ------------------------------------------------------------------ text and images
    def render(self, messages: Sequence[dict], options: ChatOptions | None) -> ChatParams:
        return self.chat.render(messages, options or ChatOptions())

    def text_and_images(self, prompt: PromptInput) -> tuple[str | tuple, list, ChatParams | None]:
        """The prompt text (or mixed prompt), its images, and the rendered chat (None for a raw prompt)."""
        image_list = list(prompt.images)
        chat = prompt.chat
        if prompt.messages is not None:
            chat = self.render(prompt.messages, prompt.chat_options)
        if chat is not None:
            text = chat.prompt
            image_list = list(chat.images) + image_list
        else:
            text = prompt.text
        if image_list and self.projector is None:
            raise ImageError("images were given but the engine has no projector: load it with mmproj=... "
                             "(--mmproj)")
        if image_list and text.count(MEDIA_MARKER) == 0:
            # Images given without markers go first, as llama.cpp's CLI does.
            text = MEDIA_MARKER * len(image_list) + "\n" + text
        return text, image_list, chat

    # ------------------------------------------------------------------ parts
    def tokenize(self, text: str | tuple, bitmaps: list[Bitmap], *, to_generate: bool = True) -> list:
        """The prompt as parts: int32 token arrays (text) and Chunk objects (media); checked against
        a sequence's share of the context. ``text`` may be a mixed prompt (a tuple of strings and
        token arrays, resolved by serving/resolver.py). ``to_generate=False`` (an embedding's prompt):
        it may end with an image, and needs no row to generate into."""
        if isinstance(text, tuple):
            parts: list = [self._mixed_tokens(text, to_generate=to_generate)]
        else:
            self.refuse_a_prompt_that_cannot_fit(text, to_generate=to_generate)
            if self.projector is not None:
                chunks = self.projector.tokenize(text, bitmaps)
                parts = [c.tokens if c.is_text else c for c in chunks]  # media chunks keep `chunks` alive
                if to_generate and self.draft_projector is not None and bitmaps:  # a vision draft model's own cut
                    pair_with_draft(parts, self.draft_projector.tokenize(text, bitmaps))
            else:
                if MEDIA_MARKER in text:
                    raise ImageError("the prompt has a media marker but the engine has no projector")
                parts = [self.model.tokenize(text, add_special=True)]
        parts = [p for p in parts if not (isinstance(p, np.ndarray) and len(p) == 0)]
        if not parts:
            raise ValueError(EMPTY_PROMPT)
        if to_generate and not isinstance(parts[-1], np.ndarray):
            raise ValueError("the prompt must end with text after the last image")
        rows = rows_of(parts)
        if rows + to_generate > self.ctx.n_ctx_seq:
            raise self.overflow(f"{rows} cache rows", rows, to_generate=to_generate)
        return parts

    def count(self, text: str, images: list) -> int:
        """The cache rows ``text`` and its ``images`` take (BOS/EOS added, special tokens parsed, each
        image its projector's tokens; images without markers first, as ``text_and_images`` puts
        them), without decoding anything (the server's token counts)."""
        if images and text.count(MEDIA_MARKER) == 0:
            text = MEDIA_MARKER * len(images) + "\n" + text
        if self.projector is None:
            return len(self.model.tokenize(text, add_special=True))
        bitmaps: list[Bitmap] = []
        try:
            for image in images:
                bitmaps.append(Bitmap.load(image))
            with self.projector.tokenize(text, bitmaps) as chunks:
                return chunks.n_tokens
        finally:
            for b in bitmaps:
                b.close()

    def _mixed_tokens(self, items: tuple, *, to_generate: bool = True) -> np.ndarray:
        """A mixed prompt's tokens as llama-server's tokenize_mixed makes them: each string tokenized
        (special tokens parsed), the first with the model's BOS when the prompt starts with it."""
        self.refuse_a_prompt_that_cannot_fit("".join(x for x in items if isinstance(x, str)), to_generate=to_generate)
        pieces = [self.model.tokenize(x, add_special=i == 0) if isinstance(x, str) else x for i, x in enumerate(items)]
        return np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)

    # ------------------------------------------------------------------ the fit check
    def overflow(self, what: str, n_rows: int, *, to_generate: bool = True) -> ContextOverflowError:
        """The error for a prompt of ``n_rows`` (at least) that does not fit a slot."""
        n_ctx = self.ctx.n_ctx_seq
        share = (f"n_ctx is {self.ctx.n_ctx}" if self.n_parallel == 1 else
                 f"each of the {self.n_parallel} slots has {n_ctx} of n_ctx {self.ctx.n_ctx}")
        # (llama-server's words first: "exceeds the available context size", which its clients look for)
        return ContextOverflowError(f"the request exceeds the available context size: the prompt needs {what}"
                                    f"{' (+1 to generate)' if to_generate else ''} but {share}; "
                                    "raise n_ctx (-c) or shorten the prompt / use smaller images",
                                    n_prompt_tokens=n_rows, n_ctx=n_ctx)

    def refuse_a_prompt_that_cannot_fit(self, text: str, *, to_generate: bool = True) -> None:
        """Refuse, before tokenizing it, a prompt whose text alone cannot fit the context.

        Tokenizing costs many times the text in memory (llama.cpp's tokenizer: about 90 bytes a
        byte) and its time runs inside one native call, so a prompt far over the context is
        refused by what it must cost at least: its bytes over the longest token, or, for a long
        text, the tokens of its first pieces (cut where a line starts, which is a word boundary
        for the BPE pre-tokenizers) once they alone pass the context. Images only add rows.
        """
        n_ctx = self.ctx.n_ctx_seq
        n_bytes = _utf8_length(text) - text.count(MEDIA_MARKER) * len(MEDIA_MARKER.encode())
        if n_bytes < n_ctx:  # fewer bytes than rows: the exact check after tokenizing decides
            return
        at_least = self.model.tokens_at_least(n_bytes)
        if at_least + to_generate > n_ctx:
            raise self.overflow(f"at least {at_least} cache rows ({n_bytes} bytes of text)", at_least,
                                to_generate=to_generate)
        if n_bytes < _COUNT_PIECES_ABOVE * n_ctx:
            return
        counted, pieces = 0, 0
        for piece in _pieces_at_line_starts(text.split(MEDIA_MARKER), _COUNT_PIECE_CHARS):
            counted += len(self.model.tokenize(piece, add_special=False))
            pieces += 1
            if counted > n_ctx + _COUNT_SLACK_PER_PIECE * pieces:
                more = counted - _COUNT_SLACK_PER_PIECE * pieces
                raise self.overflow(f"more than {more} cache rows (counted over the first {pieces} pieces of its "
                                    f"{n_bytes} bytes of text)", more + 1, to_generate=to_generate)


#: Characters encoded per C call when a text's UTF-8 length is counted (a few milliseconds of the GIL).
_ENCODE_STEP = 1 << 20


def _utf8_length(text: str) -> int:
    """The bytes of ``text`` in UTF-8 (lone surrogates as 3 each), without one C call over all of it:
    this runs beside the event loop, and a 60 MB text took some 50 ms of the GIL split and encoded whole."""
    if text.isascii():  # a flag Python keeps: no scan
        return len(text)
    return sum(len(text[at:at + _ENCODE_STEP].encode("utf-8", errors="surrogatepass"))
               for at in range(0, len(text), _ENCODE_STEP))


def _pieces_at_line_starts(segments: list[str], size: int) -> Iterator[str]:
    """The text of ``segments`` in pieces of at most ``size`` characters, each cut just before a
    line that starts with a non-space character, else just before any line, else at ``size``."""
    for seg in segments:
        start = 0
        while start < len(seg):
            end = min(start + size, len(seg))
            if end < len(seg):
                cut = _line_start_before(seg, start, end)
                end = cut if cut > start else end
            yield seg[start:end]
            start = end


def _line_start_before(text: str, start: int, end: int) -> int:
    """The last index in (start, end] just after a newline, preferring one at a non-space character
    (a word boundary for BPE pre-tokenizers); -1 when there is no newline."""
    last = at = text.rfind("\n", start, end)
    while at >= start:
        if at + 1 < len(text) and not text[at + 1].isspace():
            return at + 1
        at = text.rfind("\n", start, at)
    return last + 1 if last >= start else -1
