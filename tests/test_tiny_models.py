"""Pure-Python checks of the GGUF writer and the tiny model generator (no native library)."""

import numpy as np
import pytest

from pyllama_spec.devtools import tiny
from pyllama_spec.gguf.writer import GGUFWriter, ValueType, read_gguf_metadata


def test_gguf_writer_round_trips_values_and_aligns_data(tmp_path):
    w = GGUFWriter()
    w.add_uint8("u8", 200)
    w.add_int8("i8", -5)
    w.add_uint16("u16", 60000)
    w.add_int16("i16", -300)
    w.add_uint32("u32", 4_000_000_000)
    w.add_int32("i32", -7)
    w.add_uint64("u64", 2**40)
    w.add_int64("i64", -(2**40))
    w.add_float32("f32", 0.5)
    w.add_float64("f64", 0.1)
    w.add_bool("b", True)
    w.add_string("s", "héllo")
    w.add_array("as", ValueType.STRING, ["a", "b c"])
    w.add_array("ai", ValueType.INT32, [1, -2, 3])
    w.add_array("ab", ValueType.BOOL, [True, False])
    w.add_tensor("x", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("y", np.ones(5, dtype=np.float16))
    path = tmp_path / "t.gguf"
    w.write(path)

    meta = read_gguf_metadata(path, with_tensors=True)
    assert meta["u8"] == 200 and meta["i8"] == -5 and meta["u16"] == 60000 and meta["i16"] == -300
    assert meta["u32"] == 4_000_000_000 and meta["i32"] == -7
    assert meta["u64"] == 2**40 and meta["i64"] == -(2**40)
    assert meta["f32"] == 0.5 and meta["f64"] == 0.1 and meta["b"] is True and meta["s"] == "héllo"
    assert meta["as"] == ["a", "b c"] and meta["ai"] == [1, -2, 3] and meta["ab"] == [True, False]
    # ggml dims are the reversed numpy shape; type 0 = F32, 1 = F16
    assert meta["__tensors__"] == {"x": ((3, 2), 0), "y": ((5,), 1)}
    data = path.read_bytes()
    assert data[:4] == b"GGUF" and len(data) % 32 == 0
    # the last tensor's data sits at the end of the file, aligned
    assert data[-32:-22] == np.ones(5, dtype=np.float16).tobytes()
    with pytest.raises(KeyError):
        w.add_uint32("u8", 1)


@pytest.mark.parametrize("arch", tiny.TARGET_ARCHS)
def test_target_is_deterministic_and_has_keys(tmp_path, arch):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    tiny.write_target(a, arch=arch, seed=1, predictable=0.5)
    tiny.write_target(b, arch=arch, seed=1, predictable=0.5)
    tiny.write_target(c, arch=arch, seed=2, predictable=0.5)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()

    meta = read_gguf_metadata(a, with_tensors=True)
    assert meta["general.architecture"] == arch
    assert meta[f"{arch}.embedding_length"] == 64 and meta[f"{arch}.block_count"] == 4
    assert meta[f"{arch}.rope.dimension_sections"] == [2, 3, 3, 0]
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "qwen2"
    assert len(meta["tokenizer.ggml.tokens"]) == tiny.N_VOCAB
    assert meta["tokenizer.ggml.tokens"][tiny.MASK_TOKEN_ID] == tiny.MASK_TOKEN
    assert meta["tokenizer.ggml.eos_token_id"] == tiny.EOS_TOKEN_ID
    assert meta["tokenizer.chat_template"] == tiny.CHAT_TEMPLATE
    tensors = meta["__tensors__"]
    assert tensors["token_embd.weight"][0] == (64, tiny.N_VOCAB)
    assert tensors["output.weight"][0] == (64, tiny.N_VOCAB)
    if arch in ("qwen35", "qwen35moe"):
        assert meta[f"{arch}.full_attention_interval"] == 2
        assert "blk.0.ssm_a" in tensors and tensors["blk.1.attn_q.weight"][0] == (64, 128)
    else:
        assert tensors["blk.0.attn_k.weight"][0] == (64, 32)


def test_draft_and_mmproj_fit_the_target(tmp_path):
    models = tiny.make_tiny_set(tmp_path, window=48, predictable=0.5)
    draft = read_gguf_metadata(models.draft, with_tensors=True)
    assert draft["general.architecture"] == "dflash"
    assert draft["dflash.embedding_length"] == 64
    assert draft["dflash.target_layers"] == [1, 3]
    assert draft["dflash.block_size"] == 16
    assert draft["dflash.attention.sliding_window"] == 48
    assert draft["dflash.attention.sliding_window_pattern"] == [True]
    assert draft["tokenizer.ggml.mask_token_id"] == tiny.MASK_TOKEN_ID
    assert draft["__tensors__"]["fc.weight"][0] == (128, 64)
    assert "token_embd.weight" not in draft["__tensors__"]

    mmproj = read_gguf_metadata(models.mmproj)
    assert mmproj["clip.projector_type"] == "qwen2vl_merger"
    assert mmproj["clip.vision.projection_dim"] == 64

    with pytest.raises(ValueError):
        tiny.write_draft(tmp_path / "bad.gguf", target_layers=(4,), target_n_layer=4)


def test_make_tiny_set_reuses_files(tmp_path):
    first = tiny.make_tiny_set(tmp_path, seed=5)
    mtimes = [p.stat().st_mtime_ns for p in (first.target, first.mmproj, first.draft)]
    again = tiny.make_tiny_set(tmp_path, seed=5)
    assert again == first
    assert [p.stat().st_mtime_ns for p in (again.target, again.mmproj, again.draft)] == mtimes
    other = tiny.make_tiny_set(tmp_path, seed=5, window=None)
    assert other.draft != first.draft
    assert "dflash.attention.sliding_window" not in read_gguf_metadata(other.draft)
    assert not list(tmp_path.glob(".*.tmp"))


def test_chat_template_accepts_strings_and_parts():
    jinja2 = pytest.importorskip("jinja2")
    template = jinja2.Environment().from_string(tiny.CHAT_TEMPLATE)
    messages = [
        {"role": "system", "content": "be brief"},
        # llama-server passes image parts like this
        {"role": "user", "content": [{"type": "media_marker", "text": "<__media__>"},
                                     {"type": "text", "text": "what is this?"}]},
    ]
    assert template.render(messages=messages, add_generation_prompt=True) == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\n<__media__>what is this?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def _n_elements(tensors) -> int:
    return sum(int(np.prod(dims)) for dims, _type in tensors.values())


@pytest.mark.parametrize("arch", tiny.TARGET_ARCHS)
def test_wider_target_shapes_are_consistent(tmp_path, arch):
    # n_embd 128: heads of 64, 2 query heads, 1 KV head; f16 matrices, f32 norms and biases
    path = tiny.write_target(tmp_path / "t.gguf", arch=arch, n_embd=128, n_layer=2, n_ff=256,
                             predictable=0.5, dtype="f16")
    meta = read_gguf_metadata(path, with_tensors=True)
    assert meta[f"{arch}.embedding_length"] == 128 and meta[f"{arch}.block_count"] == 2
    assert meta[f"{arch}.feed_forward_length"] == 256
    assert meta[f"{arch}.attention.head_count"] == 2 and meta[f"{arch}.attention.head_count_kv"] == 1
    assert meta[f"{arch}.attention.key_length"] == meta[f"{arch}.attention.value_length"] == 64
    assert meta[f"{arch}.rope.dimension_count"] == 64
    sections = meta[f"{arch}.rope.dimension_sections"]
    assert sections == [8, 12, 12, 0] and sum(sections) == 64 // 2
    t = meta["__tensors__"]
    F32, F16 = 0, 1
    assert t["token_embd.weight"] == ((128, tiny.N_VOCAB), F16)
    assert t["output.weight"] == ((128, tiny.N_VOCAB), F16)
    assert t["output_norm.weight"] == ((128,), F32)
    moe = "exps" if arch == "qwen35moe" else ""  # qwen35moe: tiny.MOE_N_EXPERT experts per layer
    n_exp = (tiny.MOE_N_EXPERT,) if moe else ()
    for i in range(2):
        assert t[f"blk.{i}.attn_norm.weight"] == ((128,), F32)
        assert t[f"blk.{i}.ffn_gate{'_' * bool(moe)}{moe}.weight"] == ((128, 256, *n_exp), F16)
        assert t[f"blk.{i}.ffn_up{'_' * bool(moe)}{moe}.weight"] == ((128, 256, *n_exp), F16)
        assert t[f"blk.{i}.ffn_down{'_' * bool(moe)}{moe}.weight"] == ((256, 128, *n_exp), F16)
    hybrid = arch in ("qwen35", "qwen35moe")
    attn = 1 if hybrid else 0  # qwen35(moe): layer 0 is a delta net, layer 1 attention
    q_out = 2 * 128 if hybrid else 128
    assert t[f"blk.{attn}.attn_q.weight"] == ((128, q_out), F16)
    assert t[f"blk.{attn}.attn_k.weight"] == ((128, 64), F16)
    assert t[f"blk.{attn}.attn_v.weight"] == ((128, 64), F16)
    assert t[f"blk.{attn}.attn_output.weight"] == ((128, 128), F16)
    if arch == "qwen2vl":
        assert t["blk.0.attn_q.bias"] == ((128,), F32) and t["blk.0.attn_k.bias"] == ((64,), F32)
    else:
        assert t[f"blk.{attn}.attn_q_norm.weight"] == ((64,), F32)
    if hybrid:
        # delta net: 1 key head and 2 value heads of 64
        assert meta[f"{arch}.ssm.state_size"] == 64 and meta[f"{arch}.ssm.group_count"] == 1
        assert meta[f"{arch}.ssm.time_step_rank"] == 2 and meta[f"{arch}.ssm.inner_size"] == 128
        assert t["blk.0.attn_qkv.weight"] == ((128, 2 * 64 + 128), F16)
        assert t["blk.0.attn_gate.weight"] == ((128, 128), F16)
        assert t["blk.0.ssm_conv1d.weight"] == ((4, 2 * 64 + 128), F32)
        assert t["blk.0.ssm_a"] == ((2,), F32) and t["blk.0.ssm_norm.weight"] == ((64,), F32)
        assert t["blk.0.ssm_out.weight"] == ((128, 128), F16)
    # the parameter count make_bench_set documents
    assert _n_elements(t) == tiny.bench_n_params(n_embd=128, n_layer=2, n_ff=256, arch=arch)["target"]
    # deterministic, and f32 differs from f16 only in storage
    again = tiny.write_target(tmp_path / "again.gguf", arch=arch, n_embd=128, n_layer=2, n_ff=256,
                              predictable=0.5, dtype="f16")
    assert again.read_bytes() == path.read_bytes()
    f32 = read_gguf_metadata(tiny.write_target(tmp_path / "f32.gguf", arch=arch, n_embd=128, n_layer=2,
                                               n_ff=256, predictable=0.5), with_tensors=True)["__tensors__"]
    assert {k: d for k, (d, _) in f32.items()} == {k: d for k, (d, _) in t.items()}
    assert {ty for _, ty in f32.values()} == {F32}


def test_wider_draft_and_mmproj_fit_the_target(tmp_path):
    draft = tiny.write_draft(tmp_path / "d.gguf", target_n_embd=256, target_layers=(0, 2), target_n_layer=3,
                             n_layer=2, n_ff=512, dtype="f16")
    meta = read_gguf_metadata(draft, with_tensors=True)
    assert meta["dflash.embedding_length"] == 256
    assert meta["dflash.attention.head_count"] == 4 and meta["dflash.attention.head_count_kv"] == 2
    assert meta["dflash.attention.key_length"] == 64
    assert meta["dflash.rope.dimension_sections"] == [32, 0, 0, 0]
    t = meta["__tensors__"]
    assert t["fc.weight"] == ((2 * 256, 256), 1)
    assert t["enc.output_norm.weight"] == ((256,), 0)
    assert t["blk.1.attn_k.weight"] == ((256, 128), 1) and t["blk.1.ffn_down.weight"] == ((512, 256), 1)
    assert _n_elements(t) == tiny.bench_n_params(n_embd=256, n_ff=512, draft_n_layer=2,
                                                 n_target_layers=2)["draft"]

    mmproj = read_gguf_metadata(tiny.write_mmproj(tmp_path / "m.gguf", target_n_embd=256, dtype="f16"),
                                with_tensors=True)
    assert mmproj["clip.vision.projection_dim"] == 256
    t = mmproj["__tensors__"]
    assert t["mm.2.weight"] == ((128, 256), 1) and t["mm.2.bias"] == ((256,), 0)
    assert t["v.patch_embd.weight"][1] == 0
    q3 = read_gguf_metadata(tiny.write_mmproj(tmp_path / "m3.gguf", target_n_embd=256, dtype="f16",
                                              projector="qwen3vl_merger", deepstack_layers=(0,)),
                            with_tensors=True)["__tensors__"]
    assert q3["v.deepstack.0.fc2.weight"] == ((128, 256), 1) and q3["v.position_embd.weight"][1] == 0


def test_wider_widths_are_checked(tmp_path):
    for bad in (96, 192, 0):  # neither 64 nor a multiple of 128
        with pytest.raises(ValueError):
            tiny.write_target(tmp_path / "t.gguf", n_embd=bad)
        with pytest.raises(ValueError):
            tiny.write_draft(tmp_path / "d.gguf", target_n_embd=bad)
    with pytest.raises(ValueError):
        tiny.write_target(tmp_path / "t.gguf", dtype="bf16")
    with pytest.raises(ValueError):
        tiny.make_bench_set(tmp_path, n_layer=4, target_layers=(1, 6))  # checked before writing anything
    assert not list(tmp_path.iterdir())


def test_a_projector_of_several_vision_blocks(tmp_path):
    one = read_gguf_metadata(tiny.write_mmproj(tmp_path / "1.gguf"), with_tensors=True)
    three = read_gguf_metadata(tiny.write_mmproj(tmp_path / "3.gguf", n_block=3), with_tensors=True)
    assert (one["clip.vision.block_count"], three["clip.vision.block_count"]) == (1, 3)
    assert "v.blk.2.ffn_down.bias" in three["__tensors__"] and "v.blk.1.attn_q.weight" not in one["__tensors__"]
    for bad in (dict(n_block=0), dict(n_block=2, projector="qwen3vl_merger")):
        with pytest.raises(ValueError, match="n_block"):
            tiny.write_mmproj(tmp_path / "bad.gguf", **bad)


def test_bench_parameter_count():
    # documented in make_bench_set; checked natively against llama.cpp's count
    assert tiny.bench_n_params() == {"target": 142_135_808, "draft": 26_745_088}
