"""A seeded sweep over the shapes that broke before: image sizes and aspect ratios, batch and
ubatch sizes, draft windows, draft lengths, both position modes, dense and hybrid targets.

Every case must finish without a native failure, with greedy speculative output equal to
target-only output, and with both memories ending where the positions say. Combinations
the engine refuses by design (a recurrent target cannot roll back with n_ubatch < 3) must
be refused with a clear error before anything is decoded.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import N_THREADS

import pyllama_spec as ps
from pyllama_spec.devtools import tiny

IMAGE_SIZES = [(1, 1), (2048, 512), (512, 2048), (37, 1000), (300, 17), (224, 224), (672, 672), (1023, 97)]
BATCHES = [1, 7, 64, 115, 512]
WINDOWS = [8, 32]
DRAFT_MAX = [1, 3, 7, 15]
MODES = ["target", "sequential"]
ARCHS = ["hunyuan_vl", "qwen35"]


def _seeded_cases(n: int, seed: int, corners: list[tuple], draw) -> list[tuple]:
    """The corners first, then cases drawn from a seeded generator: a batch, a ubatch no larger,
    and ``draw(rng, n_batch, n_ubatch)`` for the rest of the case."""
    rng = random.Random(seed)
    cases = list(corners)
    while len(cases) < n:
        n_batch = rng.choice(BATCHES)
        n_ubatch = rng.choice([b for b in BATCHES if b <= n_batch])
        cases.append(draw(rng, n_batch, n_ubatch))
    return cases


def _image(size, seed=0):
    h, w = size
    return (np.random.default_rng(seed).random((h, w, 3)) * 255).astype(np.uint8)


def _speculative_equals_target_only(models, arch: str, size, n_batch: int, n_ubatch: int, check=None, **spec_kw):
    """A picture of ``size`` through the target alone, then with ``spec_kw``: no native failure, the
    same tokens and positions, the target's cache ending at pos_next and the draft's at its own
    draft_pos_next (``check(engine)`` looks further, inside). A hybrid target with n_ubatch < 3 is
    refused at load instead (it cannot roll back its recurrent state in smaller batches)."""
    prompt = f"Look: {ps.MEDIA_MARKER} and tell me."
    image = _image(size)
    common = dict(mmproj=models.mmproj, n_ctx=4096, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=N_THREADS,
                  flash_attn=False)
    if arch == "qwen35" and n_ubatch < 3:
        with pytest.raises(ValueError, match="n_ubatch >= 3"):
            ps.load(models.target, **spec_kw, **common)
        return
    with ps.load(models.target, spec_type="none", **common) as plain:
        expected = plain.generate(prompt, images=[image], max_tokens=16)
    with ps.load(models.target, **spec_kw, **common) as spec:
        got = spec.generate(prompt, images=[image], max_tokens=16)
        p = spec.positions
        assert spec.ctx.memory.pos_max() == p.pos_next - 1
        assert spec.drafter.ctx.memory.pos_max() <= p.draft_pos_next - 1
        if check is not None:
            check(spec)
    assert got.tokens == expected.tokens
    assert got.stats.prompt_positions == expected.stats.prompt_positions


# The corners first: the smallest and the most extreme image, the smallest batches.
DFLASH_CASES = _seeded_cases(28, 11, [
    ((1, 1), 1, 1, 32, 7, "target", "hunyuan_vl"), ((2048, 512), 115, 115, 32, 7, "target", "hunyuan_vl"),
    ((2048, 512), 512, 64, 8, 15, "sequential", "qwen35"), ((512, 2048), 7, 7, 8, 3, "target", "qwen35")],
    lambda rng, b, ub: (rng.choice(IMAGE_SIZES), b, ub, rng.choice(WINDOWS), rng.choice(DRAFT_MAX), rng.choice(MODES),
                        rng.choice(ARCHS)))


@pytest.mark.parametrize("case", DFLASH_CASES, ids=lambda c: "{0[0]}x{0[1]}-b{1}-ub{2}-w{3}-d{4}-{5}-{6}".format(*c))
def test_sweep_greedy_speculative_equals_target_only(case, tiny_dir):
    size, n_batch, n_ubatch, window, draft_max, mode, arch = case
    models = tiny.make_tiny_set(tiny_dir, arch=arch, seed=0, window=window, predictable=0.5)
    _speculative_equals_target_only(models, arch, size, n_batch, n_ubatch, draft=models.draft, draft_max=draft_max,
                                    draft_positions=mode)


EAGLE3_CASES = _seeded_cases(14, 13, [
    ((2048, 512), 115, 115, 7, "target", "hunyuan_vl"), ((512, 2048), 64, 7, 3, "sequential", "qwen35"),
    ((1, 1), 1, 1, 15, "target", "qwen35")],
    lambda rng, b, ub: (rng.choice(IMAGE_SIZES), b, ub, rng.choice(DRAFT_MAX), rng.choice(MODES), rng.choice(ARCHS)))


@pytest.mark.parametrize("case", EAGLE3_CASES, ids=lambda c: "{0[0]}x{0[1]}-b{1}-ub{2}-d{3}-{4}-{5}".format(*c))
def test_sweep_eagle3_greedy_speculative_equals_target_only(case, tiny_dir):
    """The same shapes through an EAGLE3 draft, whose 1-D cache holds an image's pinned rows spread
    over the image's positions: no native failure, the target's output, both caches in step."""
    size, n_batch, n_ubatch, draft_max, mode, arch = case
    models = tiny.make_tiny_set(tiny_dir, arch=arch, seed=0, window=32, predictable=0.5)
    draft = tiny.write_eagle3_draft(tiny_dir / f"eagle3-{arch}.gguf", models.target)
    _speculative_equals_target_only(models, arch, size, n_batch, n_ubatch, draft=draft, spec_type="draft-eagle3",
                                    draft_max=draft_max, draft_positions=mode)


#: The draft VLM's projectors: qwen2vl with patch 16 (another grid than the targets' 14), patch 12
#: (more rows than the target's: the draft keeps to the target's row count and may skip it) and a
#: qwen3vl one with the targets' patch (its deepstack rows).
DRAFT_VLMS = [("qwen2vl", 16), ("qwen2vl", 12), ("qwen3vl", 14)]
VISION_DRAFT_CASES = _seeded_cases(12, 17, [
    ((2048, 512), 115, 115, 7, "hunyuan_vl", ("qwen2vl", 12)), ((512, 2048), 64, 7, 3, "qwen35", ("qwen3vl", 14)),
    ((1, 1), 1, 1, 15, "hunyuan_vl", ("qwen2vl", 16))],
    lambda rng, b, ub: (rng.choice(IMAGE_SIZES), b, ub, rng.choice(DRAFT_MAX), rng.choice(ARCHS),
                        rng.choice(DRAFT_VLMS)))


@pytest.mark.parametrize("case", VISION_DRAFT_CASES,
                         ids=lambda c: "{0[0]}x{0[1]}-b{1}-ub{2}-d{3}-{4}-{5[0]}p{5[1]}".format(*c))
def test_sweep_vision_draft_model_greedy_speculative_equals_target_only(case, tiny_dir):
    """The same shapes through a vision draft model (draft-simple with its own projector), which
    decodes each picture at its own positions on its own grid: no native failure, the target's
    output, the draft's cache ending where its own positions say, and its picture rows there
    unless its grid has more rows than the target's."""
    size, n_batch, n_ubatch, draft_max, arch, (draft_arch, patch) = case
    models = tiny.make_tiny_set(tiny_dir, arch=arch, seed=0, window=32, predictable=0.5)
    vlm = tiny.make_draft_vlm(tiny_dir, arch=draft_arch, patch=patch, n_layer=3 if draft_arch == "qwen3vl" else 2)

    def holds_the_picture(spec):
        assert spec.drafter.media_skipped <= 1
        if patch >= 14:  # a grid no finer than the target's: the draft holds the picture
            assert spec.drafter.media_skipped == 0

    _speculative_equals_target_only(models, arch, size, n_batch, n_ubatch, check=holds_the_picture,
                                    draft=vlm.model, mmproj_draft=vlm.mmproj, draft_max=draft_max)
