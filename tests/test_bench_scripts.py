"""Short smoke runs of the bench/ scripts whose tables bench/RESULTS.md quotes (benchmarks are not
tests: no timings checked; what is checked is that they run, count, and find the output lossless)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import needs_llama_server

REPO = Path(__file__).resolve().parent.parent


def _run(args: list[str], timeout: int = 600) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@needs_llama_server
def test_drafters_after_images_runs_every_condition_on_both_engines_with_repeats(tmp_path):
    out = tmp_path / "rows.json"
    _run(["bench/drafters_after_images.py", "--prompts", "1", "--max-tokens", "8", "--temps", "0,0.8",
          "--repeats", "2", "--only", "target only,text-only draft model,vision draft model", "--json", str(out)])
    rows = json.loads(out.read_text())
    ours = [r for r in rows if r["engine"] == "pyllama-spec"]
    assert {(r["method"], r["condition"], r["temp"]) for r in ours} == {
        (m, c, t) for m in ("target only", "text-only draft model", "vision draft model")
        for c in ("text", "image, then 400", "right after image") for t in (0.0, 0.8)}
    assert all(r["lossless"] for r in ours)  # greedy and seeded: the target alone's tokens
    assert all(r[f"{speed}_min"] <= r[speed] <= r[f"{speed}_max"] for r in rows for speed in
               ("tokens_per_s", "wall_tokens_per_s"))
    drafting = [r for r in ours if r["method"] != "target only"]
    assert all(r["drafted"] > 0 for r in drafting)
    # llama-server runs the target alone and the draft model (-md), and has no draft projector: no row
    # of its for that one
    theirs = {(r["method"], r["condition"], r["temp"]) for r in rows if r["engine"] == "llama-server"}
    assert {m for m, _, _ in theirs} == {"target only", "text-only draft model"} and len(theirs) == 12


@needs_llama_server
def test_concurrent_chats_runs_the_mtp_head_on_four_slots_beside_llama_server(tmp_path):
    out = tmp_path / "levels.json"
    text = _run(["bench/concurrent_chats.py", "--models", "qwen35-mtp", "--concurrency", "1,4", "--repeats", "1",
                 "--max-tokens", "8", "--json-out", str(out)])
    levels = json.loads(out.read_text())["levels"]
    assert set(levels) == {"1", "4"}
    for per in levels.values():
        assert set(per) == {"pyllama-spec", "llama-server"}  # no "auto": the planned length is DFlash's
        for engine, p in per.items():
            assert p["lossless"] == p["total"] > 0  # batched answers equal the sequential ones
            if engine == "pyllama-spec":  # and each slot drafts and accepts what its request does alone
                assert p["same_drafts"] == p["total"]
            assert p["drafted"] > 0
    assert "ratio pyllama-spec / llama-server" in text


@needs_llama_server
def test_chain_drafters_alternates_rounds_and_counts_the_same_drafts_as_llama_server():
    text = _run(["bench/chain_drafters.py", "--rounds", "2", "--prompts", "2", "--max-tokens", "16",
                 "--only", "target only,EAGLE3,qwen35: target only,qwen35: MTP"])
    rounds = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert [r["round"] for r in rounds] == [0] * 4 + [1] * 4  # every method in every round
    assert [r["method"] for r in rounds[:4]] == [r["method"] for r in rounds[4:]][::-1]  # the order alternates
    eagle3 = [r for r in rounds if r["method"] == "EAGLE3"]
    assert all(r["drafted"][0] == r["drafted"][1] > 0 for r in eagle3)  # the same drafts on both engines
    assert "| EAGLE3 | 7 |" in text and "here / llama-server, per round" in text


def test_prompt_cache_bench_decodes_fewer_rows_with_the_cache_and_the_same_text():
    out = _run(["bench/prompt_cache.py", "--conversations", "2", "--turns", "2", "--max-tokens", "8",
                "--repeats", "1"])
    rows = {line.split("|")[1].strip(): int(line.split("|")[2].split("/")[1])
            for line in out.splitlines() if line.startswith("| ") and "MiB" in line}
    assert rows["256 MiB"] < rows["0 MiB"], out
    assert out.rstrip().endswith("same text: True"), out


def test_drafting_off_bench_runs_every_method_against_target_only():
    out = _run(["bench/drafting_off.py", "--prompts", "2", "--max-tokens", "8", "--repeats", "1"])
    rows = [line for line in out.splitlines() if line.startswith("| embedded |")]
    assert len(rows) == 5, out  # every method; each output was checked against target-only's


def test_serve_slots_bench_runs_both_servers_and_finds_the_same_answers():
    out = _run(["bench/serve_slots.py", "--prompts", "2", "--max-tokens", "8", "--rounds", "1", "--streams", "1,2"])
    rows = [line for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 4, out


def _bench_size_run(script: str, draft_max: str, tmp_path) -> tuple[dict, list[dict], str]:
    """One short round of a bench-size script: its JSON, its rows, its printed output."""
    out = tmp_path / "result.json"
    text = _run([script, "--repeats", "1", "--max-tokens", "8", "--draft-max", draft_max, "--out", str(out)])
    result = json.loads(out.read_text())
    return result, list(result["rows"].values()), text


@needs_llama_server
def test_mtp_bench_size_runs_the_widened_head_on_both_engines_losslessly(tmp_path):
    result, rows, text = _bench_size_run("bench/mtp_bench_size.py", "1", tmp_path)
    assert {r["engine"] for r in rows} == {"pyllama-spec target-only", "pyllama-spec mtp 1", "llama-server target-only",
                                          "llama-server mtp 1"}
    assert {r["kind"] for r in rows} == {"text", "image"}
    assert all(r["same_tokens"] for r in rows)  # every engine's tokens equal pyllama-spec target-only's
    assert all(r["drafted"] > 0 for r in rows if r["engine"].endswith("mtp 1"))  # no draft file: the target's head
    assert result["settings"]["n_params"] == {"target": 155_005_680, "mtp_head": 13_176_960}
    assert result["drafts"]["1"]["widened"][0] > 0 and "MTP head 13,176,960 of them" in text
    # the widened files (zero heads in every attention and delta-net layer at this width) compute the trained
    # function: the same tokens and the same drafts as the trained 64-wide target and head (8 tokens: an f16
    # near tie is unlikely this early)
    assert all(f["equal"] for f in result["fidelity"].values()), text
    assert result["drafts"]["1"]["widened"] == result["drafts"]["1"]["trained"], text


@needs_llama_server
def test_ngram_widened_bench_size_runs_on_both_engines_losslessly(tmp_path):
    result, rows, text = _bench_size_run("bench/ngram_widened_bench_size.py", "3", tmp_path)
    assert {r["engine"] for r in rows} == {"pyllama-spec target-only", "pyllama-spec ngram-simple 3",
                                          "llama-server target-only", "llama-server ngram-simple 3"}
    assert all(r["same_tokens"] for r in rows)
    assert result["settings"]["n_params"]["ngram"] == 0  # a drafter with no weights
    # the same drafts on the widened target as on the trained one (they follow from the tokens)
    assert result["drafts"]["3"]["widened"] == result["drafts"]["3"]["trained"], text
