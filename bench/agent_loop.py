#!/usr/bin/env python3
"""An agent's loop, turn by turn, against `pyllama-spec serve` and `llama-server` on the same files:
a screenshot, a forced tool call, the tool's result, then the next screenshot, over one growing
conversation (system prompt, tools, every earlier screenshot and call), with the DFlash draft.

    python bench/agent_loop.py --turns 10 --agents 1,2 --repeats 3

The embedded trained pair (its random projector), Gemma 4's chat template from the pinned source
(it renders tools, tool results and images), `tool_choice: "required"` (the grammar opens the call;
a bias of 2 on "}" closes the arguments, as the code-trained model would fill them with Python),
greedy. Per server and number of agents (each agent on its slot, all at once), per turn: the prompt
rows decoded (timings.prompt_n), the rows reused (cache_n), the prefill time (prompt_ms), drafted and
accepted tokens. Turn 1 decodes the system prompt, tools and first screenshot; every later turn
should decode only what is new. Also: the same loop on pyllama-spec without the draft (its answers
must equal the drafted ones), and every server's answers compared with pyllama-spec's.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import io
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from concurrent_chats import ServerProcess  # noqa: E402

from pyllama_spec import native_build  # noqa: E402
from pyllama_spec.devtools.benchmark import free_port  # noqa: E402

MODELS = REPO / "pyllama_spec" / "models"
TOOLS = [
    {"type": "function", "function": {"name": "click", "description": "Click at a point of the screen",
                                      "parameters": {"type": "object", "properties": {
                                          "x": {"type": "integer"}, "y": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "type_text", "description": "Type text into the focused field",
                                      "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}},
]


def screenshot(agent: int, turn: int, repeat: int) -> str:
    """A distinct 128x96 picture per agent, turn and repeat (so no repeat reuses another's cache)."""
    from PIL import Image

    rng = np.random.default_rng(100_000 * repeat + 1000 * agent + turn)
    pixels = np.repeat(np.repeat(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8), 8, 0), 8, 1)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def user_turn(agent: int, turn: int, repeat: int) -> dict:
    text = "Open the settings." if turn == 0 else "Here is the screen now."
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": screenshot(agent, turn, repeat)}},
                                        {"type": "text", "text": text}]}


def run_agent(url: str, agent: int, turns: int, repeat: int) -> list[dict]:
    messages = [{"role": "system", "content": "You operate a computer through tools."}, user_turn(agent, 0, repeat)]
    out = []
    with httpx.Client(timeout=600) as client:
        for turn in range(turns):
            r = client.post(url + "/v1/chat/completions", json={
                "messages": messages, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
                "max_tokens": 64, "temperature": 0, "top_k": 1, "logit_bias": {"125": 2},
                "chat_template_kwargs": {"enable_thinking": False}})
            r.raise_for_status()
            answer = r.json()
            message = answer["choices"][0]["message"]
            calls = message.get("tool_calls") or []
            t = answer["timings"]
            out.append({"answer": [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
                        or message.get("content"),
                        "prompt_n": t["prompt_n"], "cache_n": t["cache_n"], "prompt_ms": t["prompt_ms"],
                        "draft_n": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0)})
            if not calls:  # the model did not call (it ran out of tokens): the loop cannot go on
                break
            call_id = f"call_{agent}_{turn}"
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": calls[0]["function"]}]})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": f"done ({turn})"})
            if turn + 1 < turns:
                messages.append(user_turn(agent, turn + 1, repeat))
    return out


def start(name: str, n: int, args) -> ServerProcess:
    from pyllama_spec.bindings.native_info import build_record

    template = Path(build_record()["source"]["path"]) / "models" / "templates" / "google-gemma-4-31B-it.jinja"
    common = ["-m", str(MODELS / "trained-target.gguf"), "--mmproj", str(MODELS / "trained-mmproj.gguf"),
              "-c", str(4096 * n), "-np", str(n), "-t", str(args.threads), "-b", "256", "-ub", "256",
              "-fa", "off", "--host", "127.0.0.1", "--chat-template-file", str(template)]
    draft = ["-md", str(MODELS / "trained-draft.gguf"), "--spec-type", "draft-dflash",
             "--spec-draft-n-max", str(args.draft_max)]
    port = free_port()
    if name == "llama-server":
        server = native_build.find_llama_server()
        return ServerProcess(f"llama-server -np {n}", [str(server), *common, *draft, "--port", str(port),
                                                       "--spec-draft-n-min", "0", "-td", str(args.threads),
                                                       "--no-warmup", "--jinja"], port)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    extra = draft if name == "pyllama-spec" else []
    return ServerProcess(f"{name} -np {n}", [sys.executable, "-m", "pyllama_spec", "serve", *common, *extra,
                                             "--port", str(port)], port, env)


def fmt(xs: list[float]) -> str:
    return f"{min(xs):.1f} / {statistics.median(xs):.1f} / {max(xs):.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--agents", default="1,2", help="agents at once (one slot each), comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft-max", type=int, default=7)
    args = ap.parse_args()
    if native_build.find_llama_server() is None:
        sys.exit("no llama-server: python build.py --tools")
    names = ["pyllama-spec", "llama-server", "pyllama-spec target-only"]
    for n in [int(x) for x in args.agents.split(",")]:
        servers = {name: start(name, n, args) for name in names}
        try:
            runs: dict[str, list[list[dict]]] = {name: [] for name in names}  # per repeat x agent: turns
            for repeat in range(args.repeats):
                for name in names:  # one server at a time: the others idle
                    with concurrent.futures.ThreadPoolExecutor(n) as pool:
                        runs[name] += pool.map(lambda a: run_agent(servers[name].url, a, args.turns, repeat), range(n))
        finally:
            for s in servers.values():
                s.close()
        reference = [[t["answer"] for t in agent] for agent in runs["pyllama-spec target-only"]]
        print(f"\n### {n} agent(s) at once, {args.turns} turns, {args.repeats} repeats (min / median / max)\n")
        print("| server | turn 1: rows decoded, prefill ms | turns 2+: rows decoded | turns 2+: rows reused "
              "| turns 2+: prefill ms | acceptance | answers equal target-only |")
        print("|---|---|---|---|---|---|---|")
        for name in names:
            first = [agent[0] for agent in runs[name]]
            later = [t for agent in runs[name] for t in agent[1:]]
            drafted, accepted = sum(t["draft_n"] for a in runs[name] for t in a), sum(
                t["accepted"] for a in runs[name] for t in a)
            same = sum([t["answer"] for t in agent] == ref for agent, ref in zip(runs[name], reference))
            print(f"| {name} | {statistics.median([t['prompt_n'] for t in first]):.0f}, "
                  f"{fmt([t['prompt_ms'] for t in first])} | {fmt([t['prompt_n'] for t in later])} | "
                  f"{fmt([t['cache_n'] for t in later])} | {fmt([t['prompt_ms'] for t in later])} | "
                  f"{accepted / drafted if drafted else 0:.3f} ({accepted}/{drafted}) | "
                  f"{same}/{len(reference)} |")
        print("\nper turn (pyllama-spec, median over agents and repeats): rows decoded / prefill ms / accepted of drafted")
        for turn in range(args.turns):
            at = [agent[turn] for agent in runs["pyllama-spec"] if len(agent) > turn]
            if at:
                print(f"  turn {turn + 1}: {statistics.median([t['prompt_n'] for t in at]):.0f} / "
                      f"{statistics.median([t['prompt_ms'] for t in at]):.1f} / "
                      f"{sum(t['accepted'] for t in at)} of {sum(t['draft_n'] for t in at)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
