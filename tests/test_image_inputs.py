"""Images as requests send them: every Pillow mode to the RGB the model sees (16-bit and float
scaled, never clipped), ``data:`` URIs as RFC 2397 writes them, and local files under
``--allowed-image-dir`` whose every failure is a 400, never a 500.
"""

from __future__ import annotations

import base64
import errno
import io
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import load_tiny
from PIL import Image

from pyllama_spec.bindings.image_convert import to_rgb8
from pyllama_spec.server import images
from pyllama_spec.server.errors import APIError
from pyllama_spec.server.images import ImageLimits, decode_image_url

WHERE = "messages[0].content[0]"


def _png_bytes(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def _rgb_png() -> bytes:
    return _png_bytes(Image.new("RGB", (8, 8), (10, 20, 30)))


def _gray16(values) -> Image.Image:
    return Image.fromarray(np.asarray(values, dtype=np.uint16))  # mode I;16


def _refused(url: str, limits: ImageLimits) -> APIError:
    with pytest.raises(APIError) as info:
        decode_image_url(url, limits, WHERE)
    e = info.value
    assert e.status == 400 and e.code == "invalid_image" and e.param == WHERE
    assert e.message.startswith(WHERE + ": ")
    return e


# --------------------------------------------------------------------------- pixels: to_rgb8


def _check_rgb8(rgb: np.ndarray, h: int, w: int) -> None:
    assert rgb.dtype == np.uint8 and rgb.shape == (h, w, 3) and rgb.flags.c_contiguous


def test_a_16_bit_grayscale_image_is_scaled_not_clipped():
    im = _gray16([[0, 257, 32768, 65535]])
    assert np.asarray(im.convert("RGB"))[0, 2, 0] == 255  # what Pillow alone does: the defect
    rgb = to_rgb8(im)
    _check_rgb8(rgb, 1, 4)
    assert rgb[0, :, 0].tolist() == [0, 1, 128, 255]  # value * 255 / 65535, rounded
    assert (rgb == rgb[:, :, :1]).all()  # gray: the three channels equal


@pytest.mark.parametrize("mode", ["I;16", "I;16B", "I;16L", "I;16N"])
def test_every_16_bit_byte_order_is_scaled_the_same(mode):
    values = np.array([[0, 32768], [65535, 1000]], dtype=np.uint16)
    dtype = {"I;16B": ">u2", "I;16L": "<u2"}.get(mode, "=u2")
    im = Image.frombytes(mode, (2, 2), values.astype(dtype).tobytes())
    assert im.mode == mode
    assert to_rgb8(im)[:, :, 0].tolist() == [[0, 128], [255, 4]]


def test_a_16_bit_grayscale_png_file_is_scaled_not_clipped(tmp_path):
    # a real file, read back the way Bitmap.load reads a path: mid grey must stay mid grey
    path = tmp_path / "gray16.png"
    _gray16(np.full((6, 5), 32768)).save(path)
    with Image.open(path) as im:
        assert im.mode in ("I;16", "I")  # Pillow versions differ; both are 16-bit
        rgb = to_rgb8(im)
    _check_rgb8(rgb, 6, 5)
    assert np.abs(rgb.astype(int) - 128).max() <= 1
    assert (rgb == 255).mean() == 0


@pytest.mark.parametrize("values, expected", [
    ([[0, 100, 255]], [[0, 100, 255]]),  # already 8-bit: unchanged
    ([[0, 32768, 65535]], [[0, 128, 255]]),  # 16-bit held in 32 bits: scaled like I;16
    ([[-1000, 0, 1000]], [[0, 128, 255]]),  # beyond 16 bits: min-max normalised
    ([[0, 70000, 140000]], [[0, 128, 255]]),
])
def test_a_32_bit_integer_image_is_scaled_by_its_range(values, expected):
    im = Image.fromarray(np.asarray(values, dtype=np.int32))
    assert im.mode == "I"
    rgb = to_rgb8(im)
    _check_rgb8(rgb, 1, 3)
    assert rgb[:, :, 0].tolist() == expected and (rgb == rgb[:, :, :1]).all()


@pytest.mark.parametrize("values, expected", [
    ([[0.0, 0.5, 1.0]], [[0, 128, 255]]),  # within [0, 1]: x 255
    ([[0.0, 100.4, 255.0]], [[0, 100, 255]]),  # within [0, 255]: kept, rounded
    ([[-1.0, 0.0, 1.0]], [[0, 128, 255]]),  # outside both: min-max normalised
    ([[0.0, 500.0, 1000.0]], [[0, 128, 255]]),
    ([[3.0, 3.0, 3.0]], [[3, 3, 3]]),  # a flat image stays flat
])
def test_a_float_image_is_scaled_by_its_range(values, expected):
    im = Image.fromarray(np.asarray(values, dtype=np.float32))
    assert im.mode == "F"
    rgb = to_rgb8(im)
    _check_rgb8(rgb, 1, 3)
    assert rgb[:, :, 0].tolist() == expected


def test_a_float_image_with_nan_and_infinity_still_converts():
    im = Image.fromarray(np.array([[np.nan, 0.0, 0.5, np.inf, -np.inf, 1.0]], dtype=np.float32))
    assert to_rgb8(im)[0, :, 0].tolist() == [0, 0, 128, 255, 0, 255]


def _palette(mode: str) -> Image.Image:
    im = Image.new(mode, (3, 2), 1 if mode == "P" else (1, 200))
    im.putpalette([0, 0, 0, 10, 20, 30])
    return im


@pytest.mark.parametrize("make, expected", [
    (lambda: Image.new("1", (3, 2), 1), (255, 255, 255)),
    (lambda: Image.new("L", (3, 2), 77), (77, 77, 77)),
    (lambda: _palette("P"), (10, 20, 30)),
    (lambda: _palette("PA"), (10, 20, 30)),
    (lambda: Image.new("LA", (3, 2), (77, 100)), (77, 77, 77)),  # alpha dropped, not composited
    (lambda: Image.new("La", (3, 2), (50, 128)), (99, 99, 99)),  # premultiplied: 50 / (128 / 255)
    (lambda: Image.new("RGBA", (3, 2), (10, 20, 30, 40)), (10, 20, 30)),
    (lambda: Image.new("RGBa", (3, 2), (100, 100, 100, 128)), (199, 199, 199)),
    (lambda: Image.new("CMYK", (3, 2), (255, 0, 0, 0)), (0, 255, 255)),
    (lambda: Image.new("YCbCr", (3, 2), (128, 128, 128)), (128, 128, 128)),
    (lambda: Image.new("RGB", (3, 2), (10, 20, 30)), (10, 20, 30)),
    (lambda: Image.new("RGBX", (3, 2), (10, 20, 30, 0)), (10, 20, 30)),
], ids=["1", "L", "P", "PA", "LA", "La", "RGBA", "RGBa", "CMYK", "YCbCr", "RGB", "RGBX"])
def test_every_other_mode_goes_through_pillows_rgb_conversion(make, expected):
    im = make()
    rgb = to_rgb8(im)
    _check_rgb8(rgb, 2, 3)
    assert (rgb == np.array(expected, dtype=np.uint8)).all(), rgb[0, 0]


@pytest.mark.parametrize("mode", ["LAB", "HSV"])
def test_lab_and_hsv_images_give_a_valid_rgb_array(mode):
    rgb = to_rgb8(Image.new(mode, (3, 2), (40, 90, 200)))
    _check_rgb8(rgb, 2, 3)


def test_every_mode_pillow_knows_converts():
    # a mode added to Pillow later must not make Bitmap.load fail with an unexpected error
    for mode in Image.MODES:
        _check_rgb8(to_rgb8(Image.new(mode, (3, 2))), 2, 3)


# --------------------------------------------------------------------------- pixels: Bitmap.load


@pytest.fixture
def gray16_png(tmp_path) -> tuple[Path, np.ndarray]:
    """A 16-bit grayscale PNG and the RGB the model should see: 32768 -> 128, not 255."""
    values = np.array([[0, 32768, 65535], [32768, 32768, 1000]], dtype=np.uint16)
    path = tmp_path / "gray16.png"
    _gray16(values).save(path)
    gray = np.array([[0, 128, 255], [128, 128, 4]], dtype=np.uint8)
    return path, np.ascontiguousarray(np.repeat(gray[:, :, None], 3, axis=2))


def test_bitmap_load_scales_a_16_bit_png_given_as_bytes_a_path_or_a_pil_image(gray16_png):
    from pyllama_spec.bindings.mtmd import Bitmap, image_id

    path, expected = gray16_png
    # a Bitmap's id is a hash of the exact pixels it was given, so equal ids mean equal pixels
    with Image.open(path) as im:
        bitmaps = [Bitmap.load(path.read_bytes()), Bitmap.load(path), Bitmap.load(str(path)), Bitmap.load(im)]
    clipped = image_id(np.asarray(_gray16([[0]]).convert("RGB")))
    for bitmap in bitmaps:
        assert (bitmap.height, bitmap.width) == (2, 3)
        assert bitmap.id == image_id(expected) != clipped


# --------------------------------------------------------------------------- data: URIs


@pytest.mark.parametrize("header", [
    "data:image/png;base64",
    "data:IMAGE/PNG;BASE64",  # RFC 2397: media type and parameters are case-insensitive
    "data:Image/Png;Base64",
    "DATA:image/png;base64",  # so is the URI scheme (RFC 3986)
    "data:image/png;charset=utf-8;base64",  # parameters before ;base64 are allowed
    "data:image/png;name=a.png;charset=US-ASCII;BASE64",
])
def test_a_data_uri_is_read_whatever_the_case_of_its_media_type_and_base64_token(header):
    png = _rgb_png()
    assert decode_image_url(header + "," + base64.b64encode(png).decode(), ImageLimits(), WHERE) == png


@pytest.mark.parametrize("header", [
    "data:image/png",  # not base64 at all
    "data:image/png;base64;charset=utf-8",  # base64 must be the last parameter
    "data:image/png;base64x",
    "data:image/png;notbase64",
    "data:;base64",  # no media type: text/plain by RFC 2397
])
def test_a_data_uri_that_is_not_base64_as_its_last_parameter_is_refused(header):
    e = _refused(header + "," + base64.b64encode(_rgb_png()).decode(), ImageLimits())
    assert "base64" in e.message or "unsupported image type" in e.message


def test_a_data_uri_without_a_comma_is_refused():
    _refused("data:image/png;base64", ImageLimits())


def test_a_data_uri_of_an_unsupported_type_is_refused():
    e = _refused("data:IMAGE/GIF;BASE64," + base64.b64encode(_rgb_png()).decode(), ImageLimits())
    assert "image/gif" in e.message


def test_a_data_uri_that_is_not_valid_base64_is_refused():
    assert "not valid base64" in _refused("data:image/png;BASE64,!!notbase64", ImageLimits()).message


def test_an_oversized_data_uri_is_refused_before_it_is_decoded(monkeypatch):
    # the work done must be bounded by the limit, not by what the client sent
    def never(*args, **kwargs):
        raise AssertionError("an oversized payload was base64-decoded")

    monkeypatch.setattr(images.base64, "b64decode", never)
    e = _refused("data:image/png;base64," + "A" * 4000, ImageLimits(max_bytes=1000))
    assert "larger than 1000 bytes" in e.message


# --------------------------------------------------------------------------- a request's images together


def _chat_with_images(n: int, side: int, last_side: int | None = None) -> dict:
    def uri(side):
        return "data:image/png;base64," + base64.b64encode(_png_bytes(Image.new("RGB", (side, side)))).decode()

    sides = [side] * (n - 1) + [last_side or side]
    parts = [{"type": "image_url", "image_url": {"url": uri(s)}} for s in sides] + [{"type": "text", "text": "x"}]
    return {"messages": [{"role": "user", "content": parts}]}


def _limits(**images_limits):
    from pyllama_spec.server.schema import RequestLimits

    return RequestLimits(max_tokens=8, default_max_tokens=4, draft_max=0, images=ImageLimits(**images_limits))


def test_an_agents_conversation_may_carry_dozens_of_screenshots_by_default():
    from pyllama_spec.server.schema import parse_chat

    assert parse_chat(_chat_with_images(40, 16), _limits()).n_images == 40


@pytest.mark.parametrize("route", ["chat", "completion"])
def test_more_images_than_a_request_may_hold_is_a_400_and_the_one_past_the_limit_is_not_decoded(route, monkeypatch):
    from pyllama_spec.server.prompts import parse_prompts
    from pyllama_spec.server.schema import parse_chat

    decoded = []
    monkeypatch.setattr(images, "_check_decodable", lambda *a: decoded.append(a[2]))
    with pytest.raises(APIError) as info:
        if route == "chat":
            parse_chat(_chat_with_images(3, 4), _limits(max_images=2))
        else:
            payload = base64.b64encode(_rgb_png()).decode()
            parse_prompts({"prompt_string": "<__media__>" * 3 + "x", "multimodal_data": [payload] * 3},
                          n_vocab=100, images=ImageLimits(max_images=2), max_prompts=4)
    assert info.value.status == 400 and info.value.code == "too_many_images"
    assert info.value.message == "at most 2 images per request"
    assert len(decoded) == (2 if route == "chat" else 0)  # /completion counts its list first


def test_the_pixels_of_a_requests_images_together_are_bounded_read_from_their_headers(monkeypatch):
    """Decoding costs by the pixel whatever the encoded size: the image that would go over the
    request's total is refused before it is decoded (its header gives its size)."""
    from pyllama_spec.server.schema import parse_chat

    body = _chat_with_images(3, 100, last_side=99)
    loaded = []
    real_load = Image.Image.load
    monkeypatch.setattr(Image.Image, "load", lambda im: loaded.append(im.size) or real_load(im))
    with pytest.raises(APIError) as info:
        parse_chat(body, _limits(max_total_pixels=25_000))
    e = info.value
    assert e.status == 400 and e.param == "messages[0].content[2]" and "more than 25000 pixels together" in e.message
    assert (100, 100) in loaded and (99, 99) not in loaded  # the third was never decoded
    assert parse_chat(_chat_with_images(2, 100), _limits(max_total_pixels=25_000)).n_images == 2


# --------------------------------------------------------------------------- local files


@pytest.fixture
def allowed(tmp_path) -> ImageLimits:
    root = tmp_path / "allowed"
    root.mkdir()
    (root / "ok.png").write_bytes(_rgb_png())
    return ImageLimits(allowed_dir=root)


def test_a_png_under_the_allowed_folder_is_read_by_relative_absolute_or_file_path(allowed):
    png = _rgb_png()
    for url in ["ok.png", str(allowed.allowed_dir / "ok.png"), "file://" + str(allowed.allowed_dir / "ok.png")]:
        assert decode_image_url(url, allowed, WHERE) == png


def test_local_files_are_refused_without_an_allowed_folder(tmp_path):
    (tmp_path / "ok.png").write_bytes(_rgb_png())
    assert "--allowed-image-dir" in _refused(str(tmp_path / "ok.png"), ImageLimits()).message


def test_a_symlink_loop_in_the_allowed_folder_is_a_400(allowed):
    root = allowed.allowed_dir
    (root / "a").symlink_to(root / "b")
    (root / "b").symlink_to(root / "a")
    (root / "self").symlink_to(root / "self")
    for url in ["a", "self", "a/x.png"]:
        assert "symlink loop" in _refused(url, allowed).message


def test_a_path_part_over_255_characters_is_a_400(allowed):
    (allowed.allowed_dir / "sub").mkdir()  # the long part is then the first one that fails
    for url in ["x" * 300 + ".png", "sub/" + "x" * 300, str(allowed.allowed_dir / ("x" * 300))]:
        assert "too long" in _refused(url, allowed).message


def test_a_path_with_a_nul_byte_is_a_400(allowed):
    for url in ["ok.png\x00.jpg", "\x00", "file://ok\x00.png"]:
        assert "NUL" in _refused(url, allowed).message


def test_a_directory_is_a_400(allowed):
    (allowed.allowed_dir / "sub").mkdir()
    for url in ["sub", "sub/", ".", "", str(allowed.allowed_dir)]:
        assert "is a directory" in _refused(url, allowed).message


def test_a_fifo_is_refused_without_waiting_for_a_writer(allowed):
    os.mkfifo(allowed.allowed_dir / "pipe.png")
    assert "not a regular file" in _refused("pipe.png", allowed).message


def test_a_missing_file_is_a_400(allowed):
    for url in ["missing.png", "ok.png/inside.png", "nodir/x.png"]:
        assert "not found" in _refused(url, allowed).message


def _patch_os(monkeypatch, **functions) -> None:
    """Replace os functions for images.py only (pytest itself uses os.fstat and os.open)."""
    import types

    fake = types.ModuleType("os")
    fake.__dict__.update(os.__dict__)
    fake.__dict__.update(functions)
    monkeypatch.setattr(images, "os", fake, raising=False)  # raising=False: images.py before the fix had no os


def test_an_unreadable_file_is_a_400(allowed, monkeypatch):
    path = allowed.allowed_dir / "secret.png"
    path.write_bytes(_rgb_png())
    path.chmod(0)
    if os.geteuid() == 0:
        # root reads a mode-000 file anyway, so the kernel's refusal is stood in for
        def refuse(p, *args, **kwargs):
            if Path(p) == path.resolve():
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(p))
            return os.open(p, *args, **kwargs)

        _patch_os(monkeypatch, open=refuse)
    try:
        assert "permission denied" in _refused("secret.png", allowed).message
    finally:
        path.chmod(0o644)


def test_a_read_error_after_opening_is_a_400(allowed, monkeypatch):
    # an I/O error on an open file (a failing disk, a file system gone) is a 400 that says so
    def fail(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    _patch_os(monkeypatch, fstat=fail)
    assert "cannot be read (Input/output error)" in _refused("ok.png", allowed).message


def test_a_symlink_pointing_outside_the_allowed_folder_is_refused(allowed, tmp_path):
    outside = tmp_path / "outside.png"
    outside.write_bytes(_rgb_png())
    (allowed.allowed_dir / "link.png").symlink_to(outside)
    (allowed.allowed_dir / "dirlink").symlink_to(tmp_path)
    for url in ["link.png", "dirlink/outside.png", "../outside.png", str(outside), "/etc/passwd"]:
        assert "outside the allowed image folder" in _refused(url, allowed).message


def test_a_symlink_inside_the_allowed_folder_is_followed(allowed):
    (allowed.allowed_dir / "alias.png").symlink_to(allowed.allowed_dir / "ok.png")
    assert decode_image_url("alias.png", allowed, WHERE) == _rgb_png()


def test_a_local_file_over_the_size_limit_is_refused(allowed):
    limits = ImageLimits(allowed_dir=allowed.allowed_dir, max_bytes=10)
    assert "larger than 10 bytes" in _refused("ok.png", limits).message


def test_a_local_file_that_is_not_an_image_is_refused(allowed):
    (allowed.allowed_dir / "notes.png").write_text("not an image")
    assert "cannot be read" in _refused("notes.png", allowed).message


# --------------------------------------------------------------------------- through the server


def test_the_server_answers_bad_local_paths_with_400_and_upper_case_base64_with_200(tiny_dense, tmp_path):
    pytest.importorskip("httpx", reason="the test extra brings httpx")
    pytest.importorskip("starlette", reason="the server extra brings starlette")
    from starlette.testclient import TestClient

    import pyllama_spec as ps
    from pyllama_spec.server import ServerSettings, create_app

    root = tmp_path / "allowed"
    root.mkdir()
    (root / "loop").symlink_to(root / "loop")
    (root / "sub").mkdir()
    engine = load_tiny(tiny_dense, n_ctx=4096, flash_attn=False)
    try:
        with TestClient(create_app(engine, ServerSettings(allowed_image_dir=root))) as client:
            def chat(url: str):
                return client.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "hi"}]}]})

            for url in ["loop", "x" * 300, "a\x00b", "sub", "../outside.png"]:
                r = chat(url)
                assert r.status_code == 400, (url, r.text)
                err = r.json()["error"]
                assert err["code"] == "invalid_image" and err["param"] == WHERE and "Traceback" not in r.text
            r = chat("data:IMAGE/PNG;BASE64," + base64.b64encode(_rgb_png()).decode())
            assert r.status_code == 200, r.text
    finally:
        engine.close()
