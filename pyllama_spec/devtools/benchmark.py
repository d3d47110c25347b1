"""Side-by-side benchmark: pyllama-spec and llama.cpp's own llama-server, same files, same settings.

Both run in their own process (so that peak RSS is each one's own): llama-server on
127.0.0.1 on a free port, pyllama-spec in a worker process that answers JSON requests on
stdin. Requests alternate A B A B ...; the report gives medians and ratios.

    pyllama-spec bench -m T.gguf --mmproj M.gguf -md D.gguf --server PATH/llama-server
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pyllama_spec.bindings.mtmd import MEDIA_MARKER
from pyllama_spec.devtools.rpc_server import free_port

CHATML = "<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


@dataclasses.dataclass
class BenchSettings:
    model: str
    mmproj: str
    draft: str | None
    n_ctx: int = 4096
    n_batch: int = 64
    n_ubatch: int = 64
    draft_max: int = 7
    threads: int = 2
    max_tokens: int = 64
    repeats: int = 3
    image_size: int = 672
    n_gpu_layers: int = 0  # both engines, target and draft (llama-server's -ngl / -ngld)


@dataclasses.dataclass
class Sample:
    engine: str
    prompt: str  # "text" or "image"
    tokens: list[int]
    prompt_ms: float
    decode_tokens_per_s: float
    drafted: int
    accepted: int
    python_share: float | None = None  # of the generation phase; pyllama-spec only
    target_share: float | None = None
    draft_share: float | None = None


def peak_rss_mib(pid: int) -> float:
    """Peak resident set size of a live process (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def demo_png(size: int) -> bytes:
    from pyllama_spec.devtools.tiny import draw_demo_image

    buf = io.BytesIO()
    draw_demo_image(size).save(buf, format="PNG")
    return buf.getvalue()


class LlamaServer:
    """llama-server started and stopped by the harness, on 127.0.0.1 only."""

    def __init__(self, binary: str | os.PathLike, s: BenchSettings, speculative: bool) -> None:
        self.port = free_port()
        args = [str(binary), "-m", s.model, "--mmproj", s.mmproj, "-c", str(s.n_ctx), "-b", str(s.n_batch),
                "-ub", str(s.n_ubatch), "-t", str(s.threads), "-fa", "off", "--host", "127.0.0.1",
                "--port", str(self.port), "-np", "1", "--no-warmup", "-ngl", str(s.n_gpu_layers)]
        if speculative and s.draft:
            args += ["-md", s.draft, "--spec-type", "draft-dflash", "--spec-draft-n-max", str(s.draft_max),
                     "--spec-draft-n-min", "0", "-td", str(s.threads), "-ngld", str(s.n_gpu_layers)]
        # Its log goes to a file: an unread pipe would fill up and stall the server.
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        self._wait_healthy()
        # The server draws a random media marker per run; prompts must use it.
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/props", timeout=10) as r:
            self.media_marker = json.loads(r.read()).get("media_marker", MEDIA_MARKER)

    def _wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: "
                                   f"{Path(self.log.name).read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError("llama-server did not become healthy in time")

    def complete(self, prompt: str, image: bytes | None, max_tokens: int) -> dict:
        body: dict[str, Any] = {"n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                                "return_tokens": True, "samplers": ["top_k"]}
        if image is None:
            body["prompt"] = prompt
        else:
            body["prompt"] = {"prompt_string": prompt.replace(MEDIA_MARKER, self.media_marker),
                              "multimodal_data": [base64.b64encode(image).decode()]}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def sample(self, name: str, kind: str, prompt: str, image: bytes | None, max_tokens: int) -> Sample:
        out = self.complete(prompt, image, max_tokens)
        t = out["timings"]
        return Sample(name, kind, list(out.get("tokens", [])), t["prompt_ms"], t["predicted_per_second"],
                      int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0)))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


class PyllamaWorker:
    """pyllama-spec in a child process: one JSON request per line on stdin, one answer per line."""

    def __init__(self, s: BenchSettings, speculative: bool) -> None:
        cfg = dict(model=s.model, mmproj=s.mmproj, draft=s.draft if speculative else None,
                   spec_type="dflash" if speculative and s.draft else "none", n_ctx=s.n_ctx, n_batch=s.n_batch,
                   n_ubatch=s.n_ubatch, draft_max=s.draft_max, n_threads=s.threads, flash_attn=False,
                   n_gpu_layers=s.n_gpu_layers)
        # The worker imports this very copy of the package, wherever the harness runs from.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                           os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "pyllama_spec.devtools.benchmark", "worker", json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
        assert json.loads(self.proc.stdout.readline())["ready"]

    def sample(self, name: str, kind: str, prompt: str, image: bytes | None, max_tokens: int) -> Sample:
        req = {"prompt": prompt, "image": base64.b64encode(image).decode() if image else None,
               "max_tokens": max_tokens}
        self.proc.stdin.write(json.dumps(req) + "\n")
        out = json.loads(self.proc.stdout.readline())
        if "error" in out:
            raise RuntimeError(out["error"])
        return Sample(name, kind, **out)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def _worker(cfg_json: str) -> None:
    """The child side of PyllamaWorker."""
    from pyllama_spec.serving.engine import load

    with load(**json.loads(cfg_json)) as engine:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            try:
                images = [base64.b64decode(req["image"])] if req["image"] else []
                r = engine.generate(req["prompt"], images=images, max_tokens=req["max_tokens"], temperature=0.0,
                                    cache_prompt=False)
                s = r.stats
                gen = max(s.decode_seconds, 1e-9)
                print(json.dumps({"tokens": r.tokens, "prompt_ms": s.prefill_seconds * 1e3,
                                  "decode_tokens_per_s": s.tokens_per_second, "drafted": s.drafted,
                                  "accepted": s.accepted,
                                  "python_share": s.decode_python_share, "target_share": s.decode_target_seconds / gen,
                                  "draft_share": s.decode_draft_seconds / gen}), flush=True)
            except Exception as e:  # noqa: BLE001 - reported to the harness
                print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)


def run(s: BenchSettings, server_binary: str | os.PathLike, log=print) -> dict:
    """Alternate the engines over text and image prompts; return samples, medians and RSS."""
    image = demo_png(s.image_size)
    prompts = {"text": (CHATML.format(content="Write a long story about the sea."), None),
               "image": (CHATML.format(content=f"{MEDIA_MARKER}\nDescribe this picture."), image)}
    engines: dict[str, Any] = {}
    rss: dict[str, float] = {}
    samples: list[Sample] = []
    try:
        log("starting engines ...")
        engines["llama-server dflash"] = LlamaServer(server_binary, s, speculative=True)
        engines["pyllama-spec dflash"] = PyllamaWorker(s, speculative=True)
        engines["pyllama-spec target-only"] = PyllamaWorker(s, speculative=False)
        engines["llama-server target-only"] = LlamaServer(server_binary, s, speculative=False)
        for rep in range(s.repeats):
            for kind, (prompt, img) in prompts.items():
                for name, e in engines.items():  # A B A B: every engine once per round
                    samples.append(e.sample(name, kind, prompt, img, s.max_tokens))
            log(f"round {rep + 1}/{s.repeats} done")
        for name, e in engines.items():
            rss[name] = peak_rss_mib(e.proc.pid)
    finally:
        for e in engines.values():
            e.close()
    return {"settings": dataclasses.asdict(s), "samples": [dataclasses.asdict(x) for x in samples], "rss_mib": rss,
            "summary": summarize(samples, rss)}


def summarize(samples: list[Sample], rss: dict[str, float]) -> dict:
    def med(name, kind, field):
        vals = [getattr(x, field) for x in samples if x.engine == name and x.prompt == kind
                and getattr(x, field) is not None]
        return statistics.median(vals) if vals else None

    out: dict[str, Any] = {}
    for name in dict.fromkeys(x.engine for x in samples):
        for kind in ("text", "image"):
            first = next(x for x in samples if x.engine == name and x.prompt == kind)
            out[f"{name} / {kind}"] = {
                "decode_tokens_per_s": med(name, kind, "decode_tokens_per_s"),
                "prompt_ms": med(name, kind, "prompt_ms"),
                "drafted": first.drafted, "accepted": first.accepted,
                "mean_accepted_length": None,
                "python_share": med(name, kind, "python_share"),
                "target_share": med(name, kind, "target_share"),
                "draft_share": med(name, kind, "draft_share"),
                "peak_rss_mib": rss.get(name),
                "tokens": first.tokens,
            }
    r: dict[str, Any] = {}
    for kind in ("text", "image"):
        ps_, ls_ = out.get(f"pyllama-spec dflash / {kind}"), out.get(f"llama-server dflash / {kind}")
        if ps_ and ls_:
            r[f"decode tok/s pyllama/server ({kind})"] = ps_["decode_tokens_per_s"] / ls_["decode_tokens_per_s"]
            r[f"prefill pyllama/server ({kind})"] = ps_["prompt_ms"] / ls_["prompt_ms"]
            r[f"same tokens ({kind})"] = ps_["tokens"] == ls_["tokens"]
            r[f"same drafted/accepted ({kind})"] = (ps_["drafted"], ps_["accepted"]) == (ls_["drafted"],
                                                                                          ls_["accepted"])
        pt = out.get(f"pyllama-spec target-only / {kind}")
        if ps_ and pt:
            r[f"prefill dflash/target-only pyllama ({kind})"] = ps_["prompt_ms"] / pt["prompt_ms"]
    for row in out.values():
        row.pop("tokens")
    return {"medians": out, "ratios": r}


def to_markdown(result: dict) -> str:
    lines = ["| engine / prompt | decode tok/s | prompt ms | drafted | accepted | Python share | target share | "
             "draft share | peak RSS MiB |", "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for name, m in result["summary"]["medians"].items():
        lines.append(f"| {name} | {fmt(m['decode_tokens_per_s'], '.1f')} | {fmt(m['prompt_ms'], '.1f')} | "
                     f"{m['drafted']} | {m['accepted']} | {fmt(m['python_share'], '.3%')} | "
                     f"{fmt(m['target_share'], '.1%')} | {fmt(m['draft_share'], '.1%')} | "
                     f"{fmt(m['peak_rss_mib'], '.0f')} |")
    lines += ["", "| ratio | value |", "|---|---|"]
    for k, v in result["summary"]["ratios"].items():
        lines.append(f"| {k} | {v if isinstance(v, bool) else format(v, '.3f')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        _worker(sys.argv[2])
    else:
        sys.exit("usage: python -m pyllama_spec.devtools.benchmark worker CONFIG_JSON (started by the harness)")
