"""The command line: doctor, chat's banner, generate's help and demo (click's CliRunner, real native
build, real tiny models)."""

from types import SimpleNamespace

from click.testing import CliRunner

from pyllama_spec.cli import main
from pyllama_spec.cli.doctor import _gpu_offload


def test_doctor_reports_the_pin_backend_and_dflash_entry_points():
    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 0, result.output
    for needle in ("0c1e57098", "llama-cpp-python 0.3.36", "cpu", "DFlash entry points", "hunyuan_vl", "mtmd"):
        assert needle in result.output


def test_doctor_says_gpu_offload_from_the_backends_built_not_from_rpc():
    from pyllama_spec.bindings import native_info

    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 0, result.output
    line = next(ln for ln in result.output.splitlines() if "GPU offload" in ln)
    if not [b for b in native_info.backend_names() if b not in ("CPU", "BLAS", "RPC")]:
        # llama_supports_gpu_offload() is true here when RPC is built in: doctor must not say yes
        assert "no GPU backend in this build" in line, result.output


def test_gpu_offload_line_names_the_gpus_or_says_there_are_none():
    cpu, cuda0 = SimpleNamespace(name="CPU", kind="cpu"), SimpleNamespace(name="CUDA0", kind="gpu")
    assert _gpu_offload(["RPC", "CPU"], [cpu]) == \
        "no GPU backend in this build (CPU only; -ngl can offload to RPC servers' devices, --rpc)"
    assert _gpu_offload(["CPU"], [cpu]) == "no GPU backend in this build (CPU only)"
    assert _gpu_offload(["BLAS", "CPU"], [SimpleNamespace(name="BLAS", kind="accel"), cpu]).startswith("no GPU")
    assert _gpu_offload(["CUDA", "RPC", "CPU"], [cuda0, cpu]) == "yes: CUDA0 (CUDA backend)"
    assert _gpu_offload(["CUDA", "CPU"], [cpu]).startswith("no: the CUDA backend found no device")


def test_the_banner_asks_the_drafter_what_caps_draft_max():
    from pyllama_spec.cli.options import _speculative_mode

    def engine(n_max_limit, limit_reason, draft_max):
        drafter = SimpleNamespace(n_max_limit=n_max_limit, limit_reason=limit_reason)
        return SimpleNamespace(drafter=drafter, draft_max=draft_max,
                               config=SimpleNamespace(spec_type="draft-eagle3", draft_tree=0))

    assert _speculative_mode(engine(32, "this method's limit", 32), asked=40) == \
        "draft-eagle3 (draft_max 32, capped by this method's limit)"
    assert _speculative_mode(engine(32, "this method's limit", "auto"), asked="auto") == \
        "draft-eagle3 (draft_max auto, at most 32: this method's limit)"
    assert _speculative_mode(engine(6, "", 6), asked=40) == "draft-eagle3 (draft_max 6, capped from 40)"


def test_chat_banner_says_the_draft_block_caps_draft_max_and_help_says_so_too():
    result = CliRunner().invoke(main, ["chat", "-t", "1", "--draft-max", "16"], input="/quit\n", terminal_width=200)
    assert result.exit_code == 0, result.output
    banner = " ".join(result.output.split())  # rich wraps the line at the console's width
    assert "draft_max 15, capped by the draft's block size 16" in banner, result.output
    result = CliRunner().invoke(main, ["chat", "-t", "1", "--draft-max", "4"], input="/quit\n")
    assert "(draft_max 4)" in " ".join(result.output.split()), result.output
    result = CliRunner().invoke(main, ["chat", "-t", "1"], input="/quit\n")  # DFlash's measured default
    assert "draft-dflash (draft_max 5)" in " ".join(result.output.split()), result.output
    chat_help = " ".join(CliRunner().invoke(main, ["chat", "--help"]).output.split())
    assert "/image PATH" in chat_help and "@path/to/img.png" in chat_help  # how to attach an image
    help_text = " ".join(CliRunner().invoke(main, ["generate", "--help"]).output.split())
    assert "capped by a DFlash draft's block size minus one" in help_text
    assert "chat template" in help_text and "--raw" in help_text


def test_demo_runs_dflash_on_a_large_image_without_draft_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("PYLLAMA_SPEC_CACHE", str(tmp_path))  # the demo makes its random tiny models there
    result = CliRunner().invoke(main, ["demo", "--random-tiny", "--threads", "1", "--max-tokens", "12"],
                                terminal_width=200)
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in result.output.splitlines() if line.count("│") == 3 and line.split("│")[1].strip()}
    assert rows["pinned image rows skipped"] == "576"
    assert rows["prompt"].startswith("618 cache rows over 66 positions")
    assert rows["first draft block at"].startswith("position 66 (pos_next 66")
    assert rows["same output as target-only"] == "yes"


def test_serve_refuses_what_it_cannot_do_with_a_message(tmp_path):
    result = CliRunner().invoke(main, ["serve", "-np", "0"])
    assert result.exit_code == 2 and "--parallel" in result.output
    result = CliRunner().invoke(main, ["serve", "-np", "8", "-b", "4", "-ub", "4", "--port", "1"])
    assert result.exit_code == 1 and "n_parallel" in result.output, result.output
    result = CliRunner().invoke(main, ["serve", "-m", str(tmp_path / "none.gguf"), "--port", "1"])
    assert result.exit_code == 1 and "none.gguf" in result.output


def test_errors_name_the_setting_in_the_interfaces_words(tmp_path):
    """Issue 44: a projector given as the model, a short flag glued to a word, a llama-server flag a
    command lacks: each said something else (a corrupt GGUF, "'d' is not a valid integer", "no such
    option")."""
    import pytest

    import pyllama_spec as ps

    mmproj = str(ps.embedded_models().mmproj)
    r = CliRunner().invoke(main, ["generate", "-m", mmproj, "-p", "hi", "-n", "2"])
    assert r.exit_code != 0 and "is a projector (an mmproj file), not a model" in r.output and "--mmproj" in r.output
    r = CliRunner().invoke(main, ["generate", "-cd", "4096", "-p", "hi"])
    assert r.exit_code == 2 and "no such option: -cd (-c takes a number: -c 4096)" in r.output, r.output
    r = CliRunner().invoke(main, ["chat", "--no-warmup"])
    assert r.exit_code == 2 and "--no-warmup is a llama-server flag that `chat` does not take" in r.output, r.output
    with pytest.raises(ps.ModelFileError, match=r"pass it as mmproj=\.\.\. \(--mmproj\)"):
        ps.load(mmproj)
