"""Local vs split over loopback RPC: tokens/s, and what crosses the link per target step.

    python bench/rpc_split.py [--models trained|bench] [--max-tokens 128] [--repeats 5] [--json OUT]

Two ggml-rpc-server processes on 127.0.0.1 (this build's, one thread each) hold the target's
later layers (``tensor_split`` 1,1); this machine's CPU keeps the first ``--local-layers``.
For text and an image prompt, target-only and DFlash, local and split runs alternate
(L S L S ...); each repeat starts from an empty cache. tokens/s is decode tokens/s
(``stats.tokens_per_second``); min / median / max over the repeats.

Bytes per step come from a separate run through a counting TCP proxy in front of each server:
the prompt is decoded first (max_tokens=0), the counters are zeroed, then the generation runs on
the cached prompt, so what is counted is the decode phase only: bytes each way per target step
(verify step, plus the first token), and ggml RPC commands per step by kind (the client's
stream is parsed: | cmd 1 byte | size 8 bytes | payload |). "waits" are the commands whose
answer the client waits for (a round trip each; GET_TENSOR above all).

Models: ``trained`` is the embedded trained pair (4 layers, n_embd 64: real acceptance, tiny
compute), ``bench`` the random 142M-parameter f16 set (12 layers, n_embd 1024: bytes that scale
like a real model's rows, acceptance meaningless).
"""

from __future__ import annotations

import argparse
import collections
import json
import socket
import statistics
import struct
import sys
import threading
import time

import pyllama_spec as ps
from pyllama_spec import native_build
from pyllama_spec.devtools import tiny
from pyllama_spec.devtools.rpc_server import LocalRPCServer
from pyllama_spec.embedded import PROMPT as CODE_PROMPT
from pyllama_spec.gguf.reader import read_gguf_shared

# ggml-rpc.cpp's enum rpc_cmd at the pin, and which commands the client waits an answer for
CMDS = ["ALLOC_BUFFER", "GET_ALIGNMENT", "GET_MAX_SIZE", "BUFFER_GET_BASE", "FREE_BUFFER", "BUFFER_CLEAR",
        "SET_TENSOR", "SET_TENSOR_HASH", "GET_TENSOR", "COPY_TENSOR", "GRAPH_COMPUTE", "GET_DEVICE_MEMORY",
        "INIT_TENSOR", "GET_ALLOC_SIZE", "HELLO", "DEVICE_COUNT", "GRAPH_RECOMPUTE", "MEMSET_TENSOR"]
RPC_TENSOR_NAME = slice(228, 292)  # struct rpc_tensor (packed): name[64] after id .. data; 296 bytes in all
RPC_TENSOR_SIZE = 296
WAITS = {"ALLOC_BUFFER", "GET_ALIGNMENT", "GET_MAX_SIZE", "BUFFER_GET_BASE", "SET_TENSOR_HASH", "GET_TENSOR",
         "COPY_TENSOR", "GET_DEVICE_MEMORY", "GET_ALLOC_SIZE", "HELLO", "DEVICE_COUNT"}


class CountingProxy:
    """127.0.0.1:port -> a server; counts bytes each way and parses the client's RPC commands."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.lock = threading.Lock()
        self.reset()
        threading.Thread(target=self._accept, daemon=True).start()

    def reset(self) -> None:
        with self.lock:
            self.up = self.down = 0
            self.cmds: collections.Counter[str] = collections.Counter()
            self.cmd_bytes: collections.Counter[str] = collections.Counter()
            self.set_bytes: collections.Counter[str] = collections.Counter()  # SET_TENSOR bytes by tensor name

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        pending = b""  # client stream: bytes of a command header not complete yet
        skip = 0  # payload bytes of the current command still to pass
        head, want, size = b"", 0, 0  # a SET_TENSOR's leading rpc_tensor, to name what it sets
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                dst.sendall(data)
                with self.lock:
                    if not upstream:
                        self.down += len(data)
                        continue
                    self.up += len(data)
                    view = memoryview(data)
                    while len(view):
                        if skip:
                            n = min(skip, len(view))
                            if want:
                                take = min(want, n)
                                head += bytes(view[:take])
                                want -= take
                                if not want:
                                    name = head[RPC_TENSOR_NAME].split(b"\0")[0].decode(errors="replace")
                                    self.set_bytes[name] += 9 + size
                            skip -= n
                            view = view[n:]
                            continue
                        need = 9 - len(pending)
                        pending += bytes(view[:need])
                        view = view[need:]
                        if len(pending) == 9:
                            cmd, size = struct.unpack("<BQ", pending)
                            name = CMDS[cmd] if cmd < len(CMDS) else f"cmd{cmd}"
                            self.cmds[name] += 1
                            self.cmd_bytes[name] += 9 + size
                            pending, skip = b"", size
                            if name == "SET_TENSOR":
                                head, want = b"", min(RPC_TENSOR_SIZE, size)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def _models(kind: str):
    if kind == "trained":
        return ps.embedded_models()
    return tiny.make_bench_set(native_build.cache_root() / "tiny-models")


def _load(models, spec: str, threads: int, split: dict | None):
    return ps.load(models.target, mmproj=models.mmproj, draft=models.draft if spec != "none" else None,
                   spec_type=spec, draft_max=7, n_ctx=2048, n_batch=64, n_ubatch=64, n_threads=threads,
                   flash_attn=False, **(split or {}))


def _summary(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", choices=["trained", "bench"], default="trained")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--local-layers", type=int, default=None, help="target layers kept on this CPU (default: n/3)")
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args(argv)
    models = _models(args.models)
    info = read_gguf_shared(models.target)
    n_layer = int(info.metadata[f"{info.arch}.block_count"])
    n_embd = int(info.metadata[f"{info.arch}.embedding_length"])
    local_layers = n_layer // 3 if args.local_layers is None else args.local_layers
    ngl = n_layer + 1 - local_layers  # llama.cpp offloads the last -ngl layers (the head counts as one)
    image = tiny.draw_demo_image(336)  # 144 image rows (3 ubatches of 64 but the last)
    prompts = {"text": (CODE_PROMPT, []), "image": (f"{ps.MEDIA_MARKER}\n{CODE_PROMPT}", [image])}
    report = {"models": args.models, "n_layer": n_layer, "n_embd": n_embd, "local_layers": local_layers,
              "n_gpu_layers": ngl, "max_tokens": args.max_tokens, "repeats": args.repeats, "cases": []}
    servers = [LocalRPCServer(threads=1, lifetime=3600) for _ in range(2)]
    try:
        split = dict(rpc_servers=[s.endpoint for s in servers], n_gpu_layers=ngl, tensor_split=[1, 1])
        for spec in ("none", "dflash"):
            engines = {"local": _load(models, spec, args.threads, None),
                       "split": _load(models, spec, args.threads, split)}
            try:
                for pname, (prompt, images) in prompts.items():
                    tps = {k: [] for k in engines}
                    tokens = {}
                    for _ in range(args.repeats):
                        for where, engine in engines.items():
                            engine.reset_cache()
                            r = engine.generate(prompt, images=images, max_tokens=args.max_tokens)
                            tps[where].append(r.stats.tokens_per_second)
                            tokens[where] = r.tokens
                            stats = r.stats
                    case = {"spec": spec, "prompt": pname, "same_tokens": tokens["local"] == tokens["split"],
                            "mean_accepted_length": stats.mean_accepted_length,
                            "local_tps": _summary(tps["local"]), "split_tps": _summary(tps["split"])}
                    report["cases"].append(case)
                    print(json.dumps(case), file=sys.stderr, flush=True)
            finally:
                for e in engines.values():
                    e.close()
            # bytes per step: through counting proxies
            proxies = [CountingProxy((s.host, s.port)) for s in servers]
            try:
                engine = _load(models, spec, args.threads, dict(split, rpc_servers=[p.endpoint for p in proxies]))
                with engine:
                    for pname, (prompt, images) in prompts.items():
                        engine.reset_cache()
                        engine.generate(prompt, images=images, max_tokens=0)  # the prompt, into the cache
                        for p in proxies:
                            p.reset()
                        r = engine.generate(prompt, images=images, max_tokens=args.max_tokens)
                        time.sleep(0.2)  # let the pumps count the last bytes
                        steps = r.stats.target_steps + 1  # verify steps, and the decode of the first token
                        cmds = collections.Counter()
                        cmd_bytes = collections.Counter()
                        set_bytes = collections.Counter()
                        for p in proxies:
                            cmds.update(p.cmds)
                            cmd_bytes.update(p.cmd_bytes)
                            set_bytes.update(p.set_bytes)
                        link = {"spec": spec, "prompt": pname, "target_steps": steps,
                                "rows_per_step": (r.stats.drafted + steps) / steps,
                                "up_bytes_per_step": sum(p.up for p in proxies) / steps,
                                "down_bytes_per_step": sum(p.down for p in proxies) / steps,
                                "waits_per_step": sum(v for k, v in cmds.items() if k in WAITS) / steps,
                                "commands_per_step": {k: v / steps for k, v in sorted(cmds.items())},
                                "command_bytes_per_step": {k: v / steps for k, v in sorted(cmd_bytes.items())},
                                "set_tensor_bytes_per_step": {k: v / steps for k, v in set_bytes.most_common()}}
                        report.setdefault("link", []).append(link)
                        print(json.dumps(link), file=sys.stderr, flush=True)
            finally:
                for p in proxies:
                    p.close()
    finally:
        for s in servers:
            s.close()
    print(to_markdown(report))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def to_markdown(report: dict) -> str:
    lines = [f"models: {report['models']} ({report['n_layer']} layers, n_embd {report['n_embd']}); "
             f"{report['local_layers']} layers local, -ngl {report['n_gpu_layers']} over 2 servers; "
             f"{report['max_tokens']} tokens x {report['repeats']} repeats", "",
             "| prompt | method | same tokens | mean accepted length | local tok/s min / median / max | "
             "split tok/s min / median / max | split / local (median) |", "|---|---|---|---|---|---|---|"]
    for c in report["cases"]:
        lt, st = c["local_tps"], c["split_tps"]
        lines.append(f"| {c['prompt']} | {c['spec']} | {'yes' if c['same_tokens'] else 'NO'} | "
                     f"{c['mean_accepted_length']:.2f} | {lt['min']:.0f} / {lt['median']:.0f} / {lt['max']:.0f} | "
                     f"{st['min']:.0f} / {st['median']:.0f} / {st['max']:.0f} | {st['median'] / lt['median']:.2f} |")
    lines += ["", "| prompt | method | rows / step | bytes up / step | bytes down / step | waits / step | "
              "commands / step |", "|---|---|---|---|---|---|---|"]
    for k in report.get("link", []):
        cmds = ", ".join(f"{n} {v:.1f}" for n, v in k["commands_per_step"].items())
        lines.append(f"| {k['prompt']} | {k['spec']} | {k['rows_per_step']:.2f} | {k['up_bytes_per_step']:.0f} | "
                     f"{k['down_bytes_per_step']:.0f} | {k['waits_per_step']:.1f} | {cmds} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
