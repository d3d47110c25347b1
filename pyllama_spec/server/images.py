"""Images in requests: ``data:`` URIs (base64 PNG, JPEG, WebP) and, only when the server was
started with ``--allowed-image-dir``, local files under that folder.

The image is checked here (decodable, within the pixel limit) so that a bad one is a 400
for the request that sent it, never a failure inside the engine.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import errno
import io
import os
import stat
from pathlib import Path

from pyllama_spec.server.errors import bad_request

_MIME_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    # An agent's conversation holds every screenshot so far: many images per request. Decoding
    # costs by the pixel whatever the encoded size (a flat 4096x4096 PNG is a few KiB), so the
    # pixels of all of a request's images are bounded too: by eight of the largest images.
    max_images: int = 64  # per request
    max_pixels: int = 4096 * 4096  # width x height of one image
    max_total_pixels: int = 8 * 4096 * 4096  # of all the images of one request
    max_bytes: int = 20 * 2**20  # encoded size of one image
    allowed_dir: Path | None = None  # local files are refused unless they are under this folder


class ImageBudget:
    """What one request's images may still use: how many more, and how many more pixels."""

    def __init__(self, limits: ImageLimits) -> None:
        self.limits = limits
        self.images = limits.max_images
        self.pixels = limits.max_total_pixels

    def take(self, n: int, param: str) -> None:
        """Count ``n`` more images (a 400 past max_images)."""
        if n > self.images:
            raise bad_request(f"at most {self.limits.max_images} images per request", param, code="too_many_images")
        self.images -= n

    def take_pixels(self, w: int, h: int, where: str) -> None:
        if w * h > self.pixels:
            raise _error(f"{where}: the request's images are more than {self.limits.max_total_pixels} pixels "
                         "together", where)
        self.pixels -= w * h


def _error(message: str, param: str):
    return bad_request(message, param, code="invalid_image")


def decode_image_url(url: str, limits: ImageLimits, where: str, budget: ImageBudget | None = None) -> bytes:
    """The encoded image bytes behind an image_url, checked; raises a 400 APIError."""
    if url[:5].lower() == "data:":  # URI schemes are case-insensitive (RFC 3986)
        data = _data_uri(url, limits, where)
    else:
        data = _local_file(url, limits, where)
    _check_decodable(data, limits, where, budget)
    return data


def check_image_bytes(data: bytes, limits: ImageLimits, where: str, budget: ImageBudget | None = None) -> bytes:
    """Encoded image bytes (from base64 a request sent: llama-server's multimodal_data), checked as
    an image_url's are; raises a 400 APIError."""
    if len(data) > limits.max_bytes:
        raise _error(f"{where}: the image is larger than {limits.max_bytes} bytes", where)
    _check_decodable(data, limits, where, budget)
    return data


def _data_uri(url: str, limits: ImageLimits, where: str) -> bytes:
    header, sep, payload = url[5:].partition(",")
    # RFC 2397: data:[<mediatype>][;param=value]*[;base64],<data>; the media type and the
    # parameter names are case-insensitive, and "base64" can only be the last one
    params = [p.strip().lower() for p in header.split(";")]
    mime = params[0]
    if not sep or len(params) < 2 or params[-1] != "base64":
        raise _error(f"{where}: a data URI image must be base64 encoded (data:image/png;base64,...)", where)
    if mime not in _MIME_TYPES:
        raise _error(f"{where}: unsupported image type {mime!r} (PNG, JPEG or WebP)", where)
    # checked before decoding, so that the work done is bounded by the limit, not by the request
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise _error(f"{where}: the image is larger than {limits.max_bytes} bytes", where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _error(f"{where}: the data URI is not valid base64 ({e})", where) from e


def _local_file(url: str, limits: ImageLimits, where: str) -> bytes:
    if url[:8].lower().startswith(("http://", "https://")):
        raise _error(f"{where}: remote image URLs are not fetched; send the image as a data: URI", where)
    if limits.allowed_dir is None:
        raise _error(f"{where}: local image files are refused (start the server with --allowed-image-dir DIR "
                     "to allow a folder), send the image as a data: URI", where)
    text = url[len("file://"):] if url[:7].lower() == "file://" else url
    if "\x00" in text:  # the OS cannot take it: pathlib raises ValueError
        raise _error(f"{where}: the image path {url!r} contains a NUL character", where)
    # Every way a path can fail (a symlink loop, a name longer than the file system allows, a
    # directory, no permission) is the request's fault, so each is a 400 that says which.
    try:
        root = limits.allowed_dir.resolve()
        resolved = (root / text).resolve()  # root / an absolute path is that path
    except RuntimeError as e:  # Python <= 3.12 reports a symlink loop so
        raise _error(f"{where}: the image path {url!r} is a symlink loop", where) from e
    except (OSError, ValueError) as e:
        raise _error(f"{where}: the image path {url!r} cannot be resolved ({_reason(e)})", where) from e
    # resolve() followed every symlink, so a link that points out of the folder is refused here
    if not resolved.is_relative_to(root):
        raise _error(f"{where}: {url!r} is outside the allowed image folder", where)
    try:
        # O_NONBLOCK: opening a FIFO that was put in the folder must not wait for a writer
        fd = os.open(resolved, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise _error(f"{where}: image file {url!r} {_open_problem(e)}", where) from e
    try:
        # the open file is checked, not the name, so it cannot change in between
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise _error(f"{where}: image file {url!r} is a directory", where)
        if not stat.S_ISREG(st.st_mode):
            raise _error(f"{where}: image file {url!r} is not a regular file", where)
        if st.st_size > limits.max_bytes:
            raise _error(f"{where}: the image is larger than {limits.max_bytes} bytes", where)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limits.max_bytes + 1)  # bounded even if the file grew since fstat
    except OSError as e:
        raise _error(f"{where}: image file {url!r} cannot be read ({_reason(e)})", where) from e
    finally:
        os.close(fd)
    if len(data) > limits.max_bytes:
        raise _error(f"{where}: the image is larger than {limits.max_bytes} bytes", where)
    return data


def _reason(e: Exception) -> str:
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e)


def _open_problem(e: OSError) -> str:
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return "not found"
    if e.errno == errno.ELOOP:
        return "is a symlink loop"
    if e.errno == errno.ENAMETOOLONG:
        return "has a name too long for the file system"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "cannot be read (permission denied)"
    if e.errno == errno.EISDIR:
        return "is a directory"
    return f"cannot be opened ({_reason(e)})"


def _check_decodable(data: bytes, limits: ImageLimits, where: str, budget: ImageBudget | None) -> None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size  # read from the header: nothing is decoded yet
            if w * h > limits.max_pixels:
                raise _error(f"{where}: the image is {w}x{h}, more than {limits.max_pixels} pixels", where)
            if budget is not None:
                budget.take_pixels(w, h, where)
            if im.format not in _MIME_TYPES.values():
                raise _error(f"{where}: unsupported image format {im.format} (PNG, JPEG or WebP)", where)
            im.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise _error(f"{where}: the image cannot be read ({e})", where) from e
