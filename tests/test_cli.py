"""The command line: doctor and demo (click's CliRunner, real native build, real tiny models)."""

from click.testing import CliRunner

from pyllama_spec.cli import main


def test_doctor_reports_the_pin_backend_and_dflash_entry_points():
    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 0, result.output
    for needle in ("0c1e57098", "llama-cpp-python 0.3.36", "cpu", "DFlash entry points", "hunyuan_vl", "mtmd"):
        assert needle in result.output


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
