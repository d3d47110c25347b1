"""The engine with its layers on a GPU (any ggml GPU backend this build has).

Skipped where this build sees no GPU device, which is every CPU-only machine (CI's); run by
tools/gpu_check.py on a machine with one. On one device, speculative output must equal
target-only output (flash attention off: same kernels for both).
"""

from __future__ import annotations

import logging

import pytest
from conftest import TINY_ENGINE

import pyllama_spec as ps
from pyllama_spec.bindings import native_info

GPU = [d for d in native_info.devices() if d["name"].upper() not in ("CPU",) and not d["name"].upper().startswith("CPU")]
pytestmark = pytest.mark.skipif(not GPU, reason="no GPU device in this build on this machine (the CPU backend only)")

PROMPT = f"Describe this: {ps.MEDIA_MARKER} in a few words."


def _engine(models, **kw):
    return ps.load(models.target, mmproj=models.mmproj, n_ctx=4096, **TINY_ENGINE, n_gpu_layers=99,
                   flash_attn=False, **kw)


def test_all_layers_are_offloaded(tiny_dense, caplog):
    with caplog.at_level(logging.INFO, logger="pyllama_spec.native"):
        with _engine(tiny_dense, spec_type="none"):
            pass
    offload = [r.getMessage() for r in caplog.records if "offloaded" in r.getMessage()]
    assert offload and all("offloaded" in m and m.split("offloaded")[1].split("/")[0].strip() ==
                           m.split("/")[1].split()[0] for m in offload), offload


@pytest.mark.parametrize("mode", ["target", "sequential"])
def test_dflash_on_the_gpu_is_lossless_after_an_image(mode, tiny_dense, big_image):
    with _engine(tiny_dense, spec_type="none") as plain:
        expected = plain.generate(PROMPT, images=[big_image], max_tokens=32).tokens
    with _engine(tiny_dense, draft=tiny_dense.draft, draft_max=7, draft_positions=mode) as spec:
        got = spec.generate(PROMPT, images=[big_image], max_tokens=32)
    assert got.tokens == expected and got.stats.drafted > 0
