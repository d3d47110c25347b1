"""The field's command line, on the tiny models: KV cache types for target and draft, flash
attention, thread counts, mmap/mlock, projector offload; and their refusals."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from conftest import TINY_ENGINE, load_tiny

import pyllama_spec as ps
from pyllama_spec.cli import main

PROMPT = f"Describe this: {ps.MEDIA_MARKER} in a few words."


def _engine(models, **kw):
    return load_tiny(models, n_ctx=2048, draft_max=7, **kw)


@pytest.fixture(scope="module")
def wide_target(tiny_dir):
    """A tiny target with 64-wide heads: quantized KV blocks of 32 divide them."""
    from pyllama_spec.devtools import tiny

    path = tiny_dir / "wide-target.gguf"
    if not path.exists():
        tiny.write_target(path, n_embd=128, predictable=0.5)
    return path


def test_q8_0_kv_caches_with_flash_attention_and_the_other_options(wide_target):
    kw = dict(n_ctx=1024, **TINY_ENGINE, n_threads_batch=1, use_mmap=False)
    with ps.load(wide_target, flash_attn=True, cache_type_k="q8_0", cache_type_v="q8_0", **kw) as engine:
        r = engine.generate("Hello there", max_tokens=16)
        assert len(r.tokens) == 16 and engine.ctx.memory.pos_max() == engine.positions.pos_next - 1
    with ps.load(wide_target, flash_attn=True, cache_type_k="q4_0", cache_type_v="f16", **kw) as engine:
        assert len(engine.generate("Hello there", max_tokens=4).tokens) == 4


def test_the_draft_takes_its_own_cache_types(tiny_dense, big_image):
    # The tiny draft's 16-wide heads take no quantized cache: the refusal names the draft.
    with pytest.raises(ValueError, match="draft model's K head width 16"):
        _engine(tiny_dense, flash_attn=True, cache_type_k_draft="q8_0")
    with _engine(tiny_dense, flash_attn=True, cache_type_k_draft="bf16", cache_type_v_draft="f32") as engine:
        assert len(engine.generate(PROMPT, images=[big_image], max_tokens=8).tokens) == 8


@pytest.mark.parametrize("kw,needle", [
    (dict(cache_type_v="q8_0", flash_attn=False), "needs flash attention"),
    (dict(cache_type_k="q3_k"), "not a KV cache type"),
    (dict(cache_type_v_draft="q8_0", flash_attn=False), "needs flash attention"),
    (dict(cache_type_k="q8_0", flash_attn=True), "do not divide this target model's K head width 16"),
])
def test_kv_cache_types_the_backend_cannot_use_are_refused_with_the_reason(tiny_dense, kw, needle):
    with pytest.raises(ValueError, match=needle):
        _engine(tiny_dense, **kw)


def test_cli_takes_llama_cpp_option_names(tiny_dense, big_image_png):
    args = ["generate", "-m", str(tiny_dense.target), "--mmproj", str(tiny_dense.mmproj), "-md", str(tiny_dense.draft),
            "-t", "1", "-tb", "1", "-b", "64", "-ub", "64", "-fa", "on", "-ctk", "bf16", "-ctv", "f16",
            "-ctkd", "f16", "-ctvd", "bf16", "-ngl", "0", "-ngld", "0", "--no-mmproj-offload", "--no-mmap",
            "-p", "hi", "--image", str(big_image_png), "-n", "4", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    bad = CliRunner().invoke(main, [*args, "-ctv", "q8_0", "-fa", "off"])
    assert bad.exit_code == 1 and "needs flash attention" in bad.output


def test_the_projector_has_flash_attention_auto_unless_fa_says_otherwise(tiny_dense, big_image_png, monkeypatch):
    """The projector's flash attention is auto by default (2.6x faster encodes here, and lossless: the
    target and its drafts read the same embeddings) while the model's stays off; -fa sets both, as in
    llama-server (issue 44)."""
    from pyllama_spec.serving import engine as engine_mod

    seen = []
    real = engine_mod.Engine.__init__

    def spy(self, config):
        seen.append((config.flash_attn, config.mmproj_flash_attn))
        real(self, config)

    monkeypatch.setattr(engine_mod.Engine, "__init__", spy)
    base = ["generate", "-m", str(tiny_dense.target), "--mmproj", str(tiny_dense.mmproj), "-md", str(tiny_dense.draft),
            "-t", "1", "-p", "hi", "--image", str(big_image_png), "-n", "2"]
    for extra, expected in (([], (False, None)), (["-fa", "off"], (False, False)), (["-fa", "on"], (True, True)),
                            (["-fa", "auto"], (None, None))):
        result = CliRunner().invoke(main, [*base, *extra])
        assert result.exit_code == 0, result.output
        assert seen[-1] == expected, extra
    with ps.load(tiny_dense.target, mmproj=tiny_dense.mmproj, n_threads=1) as engine:
        assert (engine.config.flash_attn, engine.config.mmproj_flash_attn) == (False, None)
        with_picture = engine.generate(f"{ps.MEDIA_MARKER}\nhi", images=[str(big_image_png)], max_tokens=4)
        assert with_picture.tokens
