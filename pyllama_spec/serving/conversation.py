"""A multi-turn conversation on an Engine: messages, attached images, session numbers, transcript.

Each turn sends the whole conversation through the chat template; the engine keeps the
longest prefix already in its caches, so earlier text is not decoded again and earlier
images are not encoded again.

>>> conv = Conversation(engine, system="You are terse.")            # doctest: +SKIP
>>> conv.attach("cat.png")
>>> for piece in conv.send("What is this?"):
...     print(piece.text, end="")
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Iterator

from pyllama_spec.errors import ImageError
from pyllama_spec.serving.engine import Engine, Piece
from pyllama_spec.speculative.stats import GenerationStats, StatsTotals

# "@path/to/image.png" inside a message attaches that image.
_INLINE_IMAGE = re.compile(r"(?<!\S)@(\S+\.(?:png|jpe?g|gif|bmp|webp|tiff?))\b", re.IGNORECASE)


class Conversation:
    """Messages so far, images waiting for the next message, and the sampling settings."""

    def __init__(self, engine: Engine, *, system: str | None = None, max_tokens: int = 512,
                 **sampling: Any) -> None:
        self.engine = engine
        self.system = system
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.pending_images: list[str] = []
        self.dropped_images: list[str] = []  # the images of the last turn, when it failed before a word
        self.last_turn_kept = False  # the last turn is in the conversation (it said something)
        self.session = StatsTotals()  # the turns so far
        self.last_stats: GenerationStats | None = None
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        """Clear the conversation and both caches."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.pending_images = []
        self.engine.reset_cache()

    def attach(self, path: str | Path) -> Path:
        """Attach an image to the next message; checked now, so a bad path fails before sending."""
        p = Path(path).expanduser()
        if not p.is_file():
            raise ImageError(f"image not found: {p}")
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(p) as im:
                im.verify()
        except (UnidentifiedImageError, OSError, SyntaxError) as e:
            raise ImageError(f"cannot read image {p}: {e}") from e
        if self.engine.projector is None:
            raise ImageError("this model has no projector (--mmproj): it cannot see images")
        self.pending_images.append(str(p))
        return p

    def take_inline_images(self, text: str) -> str:
        """Attach every ``@path.png`` in text and return the text without them."""
        for m in _INLINE_IMAGE.finditer(text):
            self.attach(m.group(1))
        return _INLINE_IMAGE.sub("", text).strip()

    def send(self, text: str) -> Iterator[Piece]:
        """Add a user message (with the attached images) and stream the reply.

        Whatever was streamed stays in the conversation, also when the reply is interrupted. A turn
        that fails (or is interrupted) before its first word leaves the conversation as it was before
        it: its message is not kept, and neither are its images (``dropped_images`` lists them).
        """
        self.dropped_images = []
        self.last_turn_kept = False
        text = self.take_inline_images(text)
        images, self.pending_images = self.pending_images, []
        content: Any = text if not images else (
            [{"type": "image", "image": path} for path in images] + [{"type": "text", "text": text}])
        self.messages.append({"role": "user", "content": content})
        reply: list[str] = []
        counted = False
        try:
            for piece in self.engine.stream(messages=self.messages, max_tokens=self.max_tokens, **self.sampling):
                reply.append(piece.text)
                if piece.stats is not None:
                    self.last_stats = piece.stats
                    self.session.add(piece.stats)
                    counted = True
                yield piece
        except BaseException:
            if not reply:  # nothing was said: the turn did not happen, and leaves no trace
                self.messages.pop()
                # Its images go too: kept, they would go with the next message and fail it again
                # (a picture too large for the context); the caller says so (``dropped_images``).
                self.dropped_images = images
                raise
            if not counted and self.engine.last_stats is not None:  # interrupted: count what was said
                self.last_stats = self.engine.last_stats
                self.session.add(self.last_stats)
            self.messages.append({"role": "assistant", "content": "".join(reply)})
            self.last_turn_kept = True
            raise
        self.messages.append({"role": "assistant", "content": "".join(reply)})
        self.last_turn_kept = True

    def transcript(self) -> dict:
        session = dataclasses.asdict(self.session)
        session = {"turns": session.pop("generations"), **session}  # the transcript's name since its first version
        return {"system": self.system, "messages": self.messages, "session": session}

    def save(self, path: str | Path) -> Path:
        """Write the transcript as JSON (images by path)."""
        p = Path(path).expanduser()
        p.write_text(json.dumps(self.transcript(), indent=2, ensure_ascii=False) + "\n")
        return p
