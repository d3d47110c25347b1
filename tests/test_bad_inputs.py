"""Bad files, images and prompts give clear, typed exceptions and leave the process usable.

Every case ends by loading a valid model and decoding with it (``assert_alive``): a failed
load must not leave native state behind that breaks the next one. Cases that could abort
the interpreter run in a child process (``run_python``) so the suite survives to report them.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import N_THREADS, TINY_ENGINE
from conftest import explain_child as explain

from pyllama_spec.bindings.batch import Batch
from pyllama_spec.bindings.context import Context
from pyllama_spec.bindings.model import Model
from pyllama_spec.bindings.mtmd import MEDIA_MARKER, Bitmap, Projector
from pyllama_spec.devtools import tiny
from pyllama_spec.errors import (
    ClosedError,
    DecodeError,
    ImageError,
    IncompatibleModelsError,
    ModelFileError,
    NativeCallError,
    ProjectorError,
    PyllamaError,
)


@pytest.fixture
def assert_alive(tiny_dense, ctx_kwargs):
    """Call it at the end of a case: a valid model (and its projector) still load and decode."""

    def check() -> None:
        with Model(tiny_dense.target) as m, Context(m, **ctx_kwargs) as ctx, \
                Projector(tiny_dense.mmproj, m, n_threads=N_THREADS) as proj:
            toks = m.tokenize("still alive")
            ctx.decode_tokens(toks, np.arange(len(toks)), outputs=True)
            logits = ctx.logits()
            assert logits.shape == (m.n_vocab,) and np.isfinite(logits).all()
            assert proj.supports_vision

    return check


@pytest.fixture
def bad_dir(tmp_path):
    return tmp_path


# ----------------------------------------------------------------------------- model files


def _truncated(tiny_dense, d):
    p = d / "truncated.gguf"
    p.write_bytes(tiny_dense.target.read_bytes()[:1000])
    return p


def _text_file(tiny_dense, d):
    p = d / "notes.gguf"
    p.write_text("this is a text file, not a model\n")
    return p


def _empty(tiny_dense, d):
    p = d / "empty.gguf"
    p.write_bytes(b"")
    return p


def _magic_only(tiny_dense, d):
    p = d / "magic.gguf"
    p.write_bytes(b"GGUF")
    return p


def _header_only(tiny_dense, d):
    p = d / "header.gguf"
    p.write_bytes(tiny_dense.target.read_bytes()[:8])
    return p


def _missing(tiny_dense, d):
    return d / "no-such-model.gguf"


def _directory(tiny_dense, d):
    p = d / "a-folder.gguf"
    p.mkdir()
    return p


def _mmproj_as_model(tiny_dense, d):
    return tiny_dense.mmproj  # a clip file is no text model


BAD_MODEL_FILES = {
    "truncated": _truncated, "text_file": _text_file, "empty": _empty, "magic_only": _magic_only,
    "header_only": _header_only, "missing": _missing, "directory": _directory,
    "mmproj_as_model": _mmproj_as_model,
}


@pytest.mark.parametrize("case", sorted(BAD_MODEL_FILES))
@pytest.mark.parametrize("role", ["target", "draft"])
def test_bad_model_file_raises_model_file_error_naming_it(case, role, tiny_dense, bad_dir, assert_alive):
    path = BAD_MODEL_FILES[case](tiny_dense, bad_dir)
    with pytest.raises(ModelFileError) as info:
        Model(path, role=role)
    msg = str(info.value)
    assert str(path) in msg
    assert role in msg
    assert isinstance(info.value, OSError) and isinstance(info.value, PyllamaError)
    assert_alive()


def test_a_truncated_model_is_refused_in_python_naming_the_file_and_the_problem(tiny_dense, bad_dir):
    path = _truncated(tiny_dense, bad_dir)
    with pytest.raises(ModelFileError, match=f"{path.name} is corrupt: .*(file|bytes)"):
        Model(path)


# ----------------------------------------------------------------------------- projector files


def test_mmproj_for_another_width_raises_projector_error(tiny_dense, bad_dir, assert_alive):
    wide = tiny.write_mmproj(bad_dir / "mmproj-128.gguf", target_n_embd=128)
    with Model(tiny_dense.target) as m:
        with pytest.raises(ProjectorError) as info:
            Projector(wide, m, n_threads=N_THREADS)
        msg = str(info.value)
        assert str(wide) in msg
        assert "64" in msg and "n_embd" in msg
        assert isinstance(info.value, ValueError)
        # the model is untouched by the failed projector
        toks = m.tokenize("ok")
        with Context(m, n_ctx=128, **TINY_ENGINE) as ctx:
            ctx.decode_tokens(toks, np.arange(len(toks)), outputs=True)
    assert_alive()


@pytest.mark.parametrize("which", ["target", "draft"])
def test_text_model_as_mmproj_raises_projector_error(which, tiny_dense, assert_alive):
    not_mmproj = getattr(tiny_dense, which)
    with Model(tiny_dense.target) as m:
        with pytest.raises(ProjectorError) as info:
            Projector(not_mmproj, m, n_threads=N_THREADS)
        assert str(not_mmproj) in str(info.value)
    assert_alive()


@pytest.mark.parametrize("case", ["truncated_mmproj", "text_file", "missing"])
def test_broken_mmproj_file_raises_a_typed_error(case, tiny_dense, bad_dir, assert_alive):
    if case == "truncated_mmproj":
        path = bad_dir / "mmproj-truncated.gguf"
        path.write_bytes(tiny_dense.mmproj.read_bytes()[:1000])
        expected = ModelFileError  # GGUF magic present, but refused by gguf_check before mtmd sees it
    elif case == "text_file":
        path = _text_file(tiny_dense, bad_dir)
        expected = ModelFileError  # refused before any native call
    else:
        path = bad_dir / "no-such-mmproj.gguf"
        expected = ModelFileError
    with Model(tiny_dense.target) as m:
        with pytest.raises(expected) as info:
            Projector(path, m, n_threads=N_THREADS)
        assert str(path) in str(info.value)
        assert "mmproj" in str(info.value) or "projector" in str(info.value)
    assert_alive()


# ----------------------------------------------------------------------------- images


def test_garbage_image_bytes_raise_image_error(assert_alive):
    with pytest.raises(ImageError, match="cannot read image"):
        Bitmap.load(b"\x00\x01 not an image " * 10)
    assert_alive()


@pytest.mark.parametrize("case", ["garbage_png", "missing", "text_file"])
def test_unreadable_image_file_raises_image_error_naming_it(case, bad_dir, assert_alive):
    if case == "garbage_png":
        path = bad_dir / "broken.png"
        path.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00garbage" * 20)
    elif case == "missing":
        path = bad_dir / "no-such-image.png"
    else:
        path = bad_dir / "notes.txt"
        path.write_text("a text file, not a picture")
    with pytest.raises(ImageError) as info:
        Bitmap.load(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)
    assert_alive()


@pytest.mark.parametrize("shape", [(16, 16), (16, 16, 4), (0, 16, 3), (16, 0, 3)])
def test_array_that_is_not_rgb_raises_image_error(shape):
    with pytest.raises(ImageError, match="RGB"):
        Bitmap.load(np.zeros(shape, dtype=np.uint8))


def test_unsupported_image_type_raises_image_error():
    with pytest.raises(ImageError, match="unsupported"):
        Bitmap.load(12345)


@pytest.mark.parametrize("n_markers,n_images", [(0, 1), (2, 1), (1, 0), (1, 2)])
def test_marker_count_must_match_images(n_markers, n_images, tiny_dense, big_image, assert_alive):
    with Model(tiny_dense.target) as m, Projector(tiny_dense.mmproj, m, n_threads=N_THREADS) as proj:
        bitmaps = [Bitmap.load(big_image) for _ in range(n_images)]
        prompt = "describe " + " and ".join([MEDIA_MARKER] * n_markers)
        with pytest.raises(ValueError, match=f"{n_markers} media marker.*{n_images} image") as info:
            proj.tokenize(prompt, bitmaps)
        assert not isinstance(info.value, NativeCallError)  # refused in Python, before mtmd
        # the projector still works with a matching prompt
        with proj.tokenize(f"describe {MEDIA_MARKER}", [Bitmap.load(big_image)]) as chunks:
            assert [c.type for c in chunks] == ["text", "image", "text"]
    assert_alive()


# ----------------------------------------------------------------------------- bad calls


def test_positions_going_backwards_raise_decode_error_naming_the_context(tiny_dense, ctx_kwargs):
    with Model(tiny_dense.target) as m, Context(m, role="target", **ctx_kwargs) as ctx:
        toks = m.tokenize("hello there")
        ctx.decode_tokens(toks, np.arange(len(toks)))
        with pytest.raises(DecodeError) as info:
            ctx.decode_tokens(toks, np.arange(len(toks)))  # M-RoPE: must continue after pos_max
        err = info.value
        assert err.role == "target" and err.n_rows == len(toks) and err.offset == 0 and err.rc == -1
        assert "target context" in str(err)
        # the context is still usable
        ctx.decode_tokens(toks[:1], [len(toks)], outputs=True)
        assert ctx.memory.pos_max() == len(toks)


def test_batch_shape_mistakes_raise_value_error(tiny_dense, ctx_kwargs):
    with Model(tiny_dense.target) as m, Context(m, **ctx_kwargs) as ctx, Batch(ctx) as batch:
        with pytest.raises(ValueError, match="positions"):
            batch.add_tokens([1, 2, 3], [0, 1])
        with pytest.raises(ValueError, match="2-D"):
            batch.add_embeddings(np.zeros(64, np.float32), np.zeros(1, np.int32))
        with pytest.raises(ValueError, match="positions of shape"):
            batch.add_embeddings(np.zeros((3, 64), np.float32), np.zeros((2, 4), np.int32))
        with pytest.raises(ValueError, match="outputs"):
            batch.add_tokens([1, 2], [0, 1], outputs=[True])
        with pytest.raises(NativeCallError, match="batch is full"):
            batch.add_tokens(np.ones(ctx.n_batch + 1, np.int32), np.arange(ctx.n_batch + 1))
        assert batch.n_rows == 0


def test_native_return_codes_pass_one_gate_each():
    """errors.py's gates: what passes, and what each refused code says (the bindings raise these)."""
    from pyllama_spec.errors import check_batch_add, check_encode, check_tokenize

    check_batch_add(5, n_rows=5, batch_rows=0, role="target")
    check_tokenize(0)
    check_encode(0, chunk_type="image", n_rows=576)
    with pytest.raises(NativeCallError, match=r"llama_batch_ext_add failed \(rc = -4\): invalid position while adding "
                                              r"3 rows to a batch of 7 \(draft context\); the batch was cleared"):
        check_batch_add(-4, n_rows=3, batch_rows=7, role="draft")
    with pytest.raises(NativeCallError, match=r"\(rc = -9\): error while adding"):
        check_batch_add(-9, n_rows=1, batch_rows=0, role="target")
    with pytest.raises(NativeCallError, match=r"mtmd_tokenize failed \(rc = 2\): image preprocessing failed"):
        check_tokenize(2)
    with pytest.raises(NativeCallError, match=r"mtmd_tokenize failed \(rc = 7\): tokenization failed"):
        check_tokenize(7)
    with pytest.raises(NativeCallError, match=r"mtmd_encode_chunk failed \(rc = 1\): image chunk of 576 rows"):
        check_encode(1, chunk_type="image", n_rows=576)
    with pytest.raises(NativeCallError, match=r"mtmd_encode_chunk failed \(rc = 1\): interrupted \(Ctrl-C\)"):
        check_encode(1, chunk_type="image", n_rows=576, interrupted=True)


def test_layer_beyond_the_target_is_refused(tiny_dense, ctx_kwargs):
    with Model(tiny_dense.target) as m, Context(m, **ctx_kwargs) as ctx:
        for lid in (-1, m.n_layer + 1):
            with pytest.raises(IncompatibleModelsError, match=f"layer {lid}"):
                ctx.enable_layer_inputs([lid])


def test_layer_id_equal_to_n_layer_is_refused_without_abort(tiny_dense, run_python):
    res = run_python("""
        import sys, numpy as np
        from pyllama_spec.bindings.context import Context
        from pyllama_spec.bindings.model import Model
        from pyllama_spec.errors import IncompatibleModelsError
        m = Model(sys.argv[1])
        ctx = Context(m, n_ctx=128, n_batch=64, n_ubatch=64, n_threads=1)
        try:
            ctx.enable_layer_inputs([m.n_layer])
        except IncompatibleModelsError:
            sys.exit(0)
        toks = m.tokenize("hello")
        ctx.decode_tokens(toks, np.arange(len(toks)))   # aborts in native code today
        print("decoded without error")
        sys.exit(5)
    """, str(tiny_dense.target))
    assert res.returncode == 0, explain(res)


def test_closed_objects_refuse_use(tiny_dense, ctx_kwargs):
    m = Model(tiny_dense.target)
    m.close()
    with pytest.raises(ClosedError, match="model is closed"):
        Context(m, **ctx_kwargs)
    with pytest.raises(ClosedError):
        Projector(tiny_dense.mmproj, m, n_threads=N_THREADS)


@pytest.mark.parametrize("when", ["before_any_decode", "enabled_after_a_decode"])
def test_layer_input_before_a_decode_is_refused_without_abort(when, tiny_dense, run_python):
    res = run_python("""
        import sys, numpy as np
        from pyllama_spec.bindings.context import Context
        from pyllama_spec.bindings.model import Model
        m = Model(sys.argv[1])
        ctx = Context(m, n_ctx=128, n_batch=64, n_ubatch=64, n_threads=1)
        ctx.enable_layer_inputs([1])
        if sys.argv[2] == "enabled_after_a_decode":
            toks = m.tokenize("hi")
            ctx.decode_tokens(toks, np.arange(len(toks)))
            ctx.enable_layer_inputs([3])
            lid = 3
        else:
            lid = 1
        try:
            ctx.layer_input(lid, 2)      # no decode has recorded this layer yet
        except ValueError:
            sys.exit(0)
        print("returned rows that no decode wrote")
        sys.exit(5)
    """, str(tiny_dense.target), when)
    assert res.returncode == 0, explain(res)
