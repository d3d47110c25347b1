"""Chat handlers of llama-cpp-python that take pictures, for ``Llama(..., chat_handler=...)``.

``clip_model_path`` is the projector (mmproj) file; the engine loads it with the model and renders the
chat with the model's own template (the GGUF's, as this project renders it for llama-server's routes),
each ``image_url`` part where the picture goes. ``image_url`` may be a ``data:`` URI (base64), a
``file://`` URL or a local path, or an ``http(s)://`` URL, fetched as llama-cpp-python fetches it.
The handlers differ only in name here: llama-cpp-python's Llava-style handlers carry a template of their
own, this facade uses the model's.
"""

from __future__ import annotations

import base64
import urllib.parse
import urllib.request
from pathlib import Path
#: The most bytes an image fetched from a URL may have.
MAX_IMAGE_BYTES = 64 * 2**20
FETCH_TIMEOUT_S = 30


class MTMDChatHandler:
    """A chat with pictures through libmtmd: ``clip_model_path`` is the model's projector file."""

    def __init__(self, clip_model_path: str, verbose: bool = True, use_gpu: bool = True) -> None:
        if not Path(clip_model_path).exists():
            raise ValueError(f"Clip model path does not exist: {clip_model_path}")
        self.clip_model_path = str(clip_model_path)
        self.verbose = verbose
        self.use_gpu = use_gpu

    @staticmethod
    def load_image(image_url: str) -> bytes | str:
        """The picture of an ``image_url``: bytes (a data URI, an http(s) URL), or a local path."""
        return load_image(image_url)


def load_image(image_url: str) -> bytes | str:
    if image_url.startswith("data:"):
        head, sep, data = image_url.partition(",")
        if not sep or ";base64" not in head:
            raise ValueError(f"an image data URI must be base64: {image_url[:40]!r}...")
        try:
            return base64.b64decode("".join(data.split()), validate=True)
        except ValueError as e:
            raise ValueError(f"the image data URI is not valid base64: {e}") from e
    scheme = urllib.parse.urlparse(image_url).scheme
    if scheme in ("http", "https"):
        with urllib.request.urlopen(image_url, timeout=FETCH_TIMEOUT_S) as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
        if len(data) > MAX_IMAGE_BYTES:
            raise ValueError(f"the image at {image_url} is over {MAX_IMAGE_BYTES} bytes")
        return data
    if scheme == "file":
        return urllib.request.url2pathname(urllib.parse.urlparse(image_url).path)
    if len(scheme) > 1:  # a one-letter scheme is a Windows drive: a path
        raise ValueError(f"image_url {image_url[:60]!r}: takes a data: URI, an http(s):// or file:// URL, or a path")
    return image_url


class Llava15ChatHandler(MTMDChatHandler):
    pass


class Llava16ChatHandler(Llava15ChatHandler):
    pass


class ObsidianChatHandler(Llava15ChatHandler):
    pass


class MoondreamChatHandler(Llava15ChatHandler):
    pass


class NanoLlavaChatHandler(Llava15ChatHandler):
    pass


class Llama3VisionAlphaChatHandler(Llava15ChatHandler):
    pass


class MiniCPMv26ChatHandler(Llava15ChatHandler):
    pass


class Qwen25VLChatHandler(Llava15ChatHandler):
    pass


class Gemma4ChatHandler(MTMDChatHandler):
    pass
