"""Images in requests: ``data:`` URIs (base64 PNG, JPEG, WebP) and, only when the server was
started with ``--allowed-image-dir``, local files under that folder.

The image is checked here (decodable, within the pixel limit) so that a bad one is a 400
for the request that sent it, never a failure inside the engine.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
from pathlib import Path

_MIME_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    max_images: int = 8  # per request
    max_pixels: int = 4096 * 4096  # width x height of one image
    max_bytes: int = 20 * 2**20  # encoded size of one image
    allowed_dir: Path | None = None  # local files are refused unless they are under this folder


def _error(message: str, param: str):
    from .schema import bad_request

    return bad_request(message, param, code="invalid_image")


def decode_image_url(url: str, limits: ImageLimits, where: str) -> bytes:
    """The encoded image bytes behind an image_url, checked; raises a 400 APIError."""
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        mime = header[5:].split(";")[0].strip().lower()
        if not sep or ";base64" not in header:
            raise _error(f"{where}: a data URI image must be base64 encoded (data:image/png;base64,...)", where)
        if mime not in _MIME_TYPES:
            raise _error(f"{where}: unsupported image type {mime!r} (PNG, JPEG or WebP)", where)
        if len(payload) * 3 // 4 > limits.max_bytes:
            raise _error(f"{where}: the image is larger than {limits.max_bytes} bytes", where)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise _error(f"{where}: the data URI is not valid base64 ({e})", where) from e
    else:
        data = _local_file(url, limits, where)
    _check_decodable(data, limits, where)
    return data


def _local_file(url: str, limits: ImageLimits, where: str) -> bytes:
    if url.startswith(("http://", "https://")):
        raise _error(f"{where}: remote image URLs are not fetched; send the image as a data: URI", where)
    if limits.allowed_dir is None:
        raise _error(f"{where}: local image files are refused (start the server with --allowed-image-dir DIR "
                     "to allow a folder), send the image as a data: URI", where)
    path = Path(url[len("file://"):] if url.startswith("file://") else url)
    root = limits.allowed_dir.resolve()
    resolved = (root / path).resolve() if not path.is_absolute() else path.resolve()
    if not resolved.is_relative_to(root):
        raise _error(f"{where}: {url!r} is outside the allowed image folder", where)
    if not resolved.is_file():
        raise _error(f"{where}: image file not found: {url!r}", where)
    if resolved.stat().st_size > limits.max_bytes:
        raise _error(f"{where}: the image is larger than {limits.max_bytes} bytes", where)
    return resolved.read_bytes()


def _check_decodable(data: bytes, limits: ImageLimits, where: str) -> None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size  # read from the header: nothing is decoded yet
            if w * h > limits.max_pixels:
                raise _error(f"{where}: the image is {w}x{h}, more than {limits.max_pixels} pixels", where)
            if im.format not in _MIME_TYPES.values():
                raise _error(f"{where}: unsupported image format {im.format} (PNG, JPEG or WebP)", where)
            im.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise _error(f"{where}: the image cannot be read ({e})", where) from e
