"""The tiny Mamba (devtools/tiny_mamba.py): a recurrent-only model that loads in the pinned llama.cpp,
generates deterministically, and that the llama-cpp-python facade sees as recurrent, not hybrid."""

from __future__ import annotations

import pytest

import pyllama_spec as ps
from pyllama_spec.devtools import tiny
from pyllama_spec.devtools.tiny_mamba import make_mamba, write_mamba
from pyllama_spec.gguf.reader import read_gguf

ENGINE = dict(spec_type="none", n_ctx=256, n_threads=2)


@pytest.fixture(scope="module")
def mamba(tmp_path_factory):
    return make_mamba(tmp_path_factory.mktemp("tiny-mamba"))


def test_the_file_holds_llama_cpps_mamba_keys_and_shapes(mamba):
    info = read_gguf(mamba, "mamba")
    meta = info.metadata
    assert meta["general.architecture"] == "mamba"
    assert (meta["mamba.ssm.inner_size"], meta["mamba.ssm.state_size"], meta["mamba.ssm.conv_kernel"],
            meta["mamba.ssm.time_step_rank"]) == (128, 16, 4, 4)
    assert len(meta["tokenizer.ggml.tokens"]) == tiny.N_VOCAB
    # ggml dims, as llama_model_mamba::load_arch_tensors creates them (d_inner 128, dt_rank 4, d_state 16)
    dims = {name: list(t.dims) for name, t in info.tensors.items() if name.startswith(("blk.0.", "token_embd"))}
    assert dims == {"token_embd.weight": [64, tiny.N_VOCAB], "blk.0.attn_norm.weight": [64],
                    "blk.0.ssm_in.weight": [64, 256], "blk.0.ssm_conv1d.weight": [4, 128],
                    "blk.0.ssm_conv1d.bias": [128], "blk.0.ssm_x.weight": [128, 36],
                    "blk.0.ssm_dt.weight": [4, 128], "blk.0.ssm_dt.bias": [128], "blk.0.ssm_a": [16, 128],
                    "blk.0.ssm_d": [128], "blk.0.ssm_out.weight": [128, 64]}


def test_it_loads_as_a_recurrent_model_and_generates_deterministically(mamba):
    with ps.load(mamba, **ENGINE) as engine:
        assert engine.model.is_recurrent and not engine.model.is_hybrid
        first = engine.generate("def f(x):", max_tokens=16, temperature=0)
        again = engine.generate("def f(x):", max_tokens=16, temperature=0)
        other = engine.generate("The quick brown fox", max_tokens=16, temperature=0)
    assert len(first.tokens) == 16 and first.finish_reason == "length"
    assert again.tokens == first.tokens
    assert other.tokens != first.tokens  # the output depends on the prompt
    assert all(t < tiny.FIRST_SPECIAL_ID for t in first.tokens) and first.text.isprintable()
    with ps.load(mamba, **ENGINE) as engine:
        assert engine.generate("def f(x):", max_tokens=16, temperature=0).tokens == first.tokens


def test_the_llama_cpp_facade_sees_a_recurrent_not_hybrid_model(mamba):
    from pyllama_spec import llama_cpp

    llm = llama_cpp.Llama(model_path=str(mamba), n_ctx=256, verbose=False)
    assert llm._is_recurrent is True
    assert llm._is_hybrid is False
    first = llm("def f(x):", max_tokens=8, temperature=0)["choices"][0]
    # the second call finds the whole prompt decoded already: the recurrent state cannot be cut back,
    # so the facade must start over, and give the same text
    second = llm("def f(x):", max_tokens=8, temperature=0)["choices"][0]
    assert first["finish_reason"] == "length" and first["text"]
    assert second["text"] == first["text"]


def test_make_mamba_writes_once_and_reuses_the_file(tmp_path):
    path = make_mamba(tmp_path)
    mtime = path.stat().st_mtime_ns
    assert make_mamba(tmp_path) == path and path.stat().st_mtime_ns == mtime
    assert make_mamba(tmp_path, seed=1) != path  # other parameters, another file
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_write_mamba_rejects_an_expansion_llama_cpp_cannot_load(tmp_path):
    with pytest.raises(ValueError, match="expand"):
        write_mamba(tmp_path / "m.gguf", expand=3)
