"""Cost model: a 72B target split over two hosts with ggml RPC, target-only vs DFlash.

    python bench/rpc_cost_model.py            # prints the Markdown tables in bench/RESULTS.md

Host A runs pyllama-spec (the loop, the DFlash draft, the output head, layers 40-79 on its GPU);
host B runs ggml-rpc-server with layers 0-39 (llama.cpp's order: remote devices first). What
crosses the link per verify step of ``rows`` rows follows the structure bench/rpc_split.py
measured (ggml RPC commands per step, parsed from the client's stream):

* up (A -> B), without flash attention as measured: the layer-0 input (rows x n_embd f32), the
  KQ mask (n_kv x rows f32), the V-cache write indices (rows x n_embd_v_gqa int64: the V cache
  is transposed without flash attention), K indices and positions, about 12 small SET_TENSOR /
  GRAPH_RECOMPUTE commands; and, when the verify length changes, the whole serialized graph
  (GRAPH_COMPUTE: measured 12.7 KB per layer);
* down (B -> A): B's last activations (rows x n_embd f32) and, for DFlash, the input of every
  draft feature layer that lives on B (rows x n_embd f32 each);
* waits (round trips, served one after another by the client's single dispatcher thread): one
  GET_TENSOR per tensor coming back, plus GET_ALLOC_SIZE queries after a shape change.

Compute is memory-bound for few rows: each host streams its half of the Q4_K_M weights once
per step, plus a per-row term. Every constant is below; change them and run again.
"""

from __future__ import annotations

# --- the target (Qwen2.5-72B / Qwen2-VL-72B class) and the hosts
N_EMBD = 8192
N_LAYER = 80
LAYERS_ON_B = 40
WEIGHTS_PER_HOST = 22e9  # bytes: Q4_K_M of 72.7 B parameters is about 44 GB
HBM = 2.5e12  # bytes/s achieved on an H100-class GPU
PER_ROW = 0.36e-3  # s per extra verify row: 2 x 72e9 FLOP at about 400 TFLOP/s achieved
DRAFT = 1.5e-3  # s per DFlash draft step on host A (a ~1B block-diffusion draft, one forward)
N_KV = 4096  # KV cells in use (the mask's width)
N_EMBD_V_GQA = 1024  # 8 KV heads x 128
FEATURE_LAYERS_ON_B = 3  # of a 5-layer DFlash feature set spread over the depth
GRAPH_BYTES_PER_LAYER = 12_700  # measured: a GRAPH_COMPUTE of 3 tiny-target layers was 38 KB
SMALL_COMMANDS = 14 * 64  # bytes: the per-step SET_TENSOR headers, GRAPH_RECOMPUTE, GET_TENSOR requests
REBUILD = {"none": 0.0, "dflash": 0.25}  # share of steps whose verify length changes (measured 0.2-0.3)
ALLOC_WAITS = {"none": 0.0, "dflash": 0.3}  # GET_ALLOC_SIZE round trips per step after such a change

# --- mean accepted length (tokens per verify step) of the embedded trained pair, bench/RESULTS.md
CASES = [  # (label, draft_max, tokens per step)
    ("greedy text, draft_max 7", 7, 4.68),
    ("greedy after an image, draft_max 7", 7, 5.02),
    ("greedy text, draft_max 3", 3, 3.25),
    ("greedy text, draft_max 15", 15, 5.61),
    ("temp 0.8 text, draft_max 7", 7, 2.37),
    ("temp 1.0 text, draft_max 7", 7, 1.99),
    ("temp 0.8 text, draft_max 1", 1, 1.61),
]
LINKS = [(1, 0.1e-3), (1, 1e-3), (10, 0.1e-3), (10, 0.5e-3), (10, 1e-3), (25, 0.1e-3), (25, 1e-3)]


def step(rows: int, method: str, gbit: float, rtt: float, features_on_b: int = FEATURE_LAYERS_ON_B) -> dict:
    """Seconds of one verify step of ``rows`` rows, and its parts."""
    row_bytes = rows * N_EMBD * 4
    up = (row_bytes + rows * (N_KV * 4 + N_EMBD_V_GQA * 8 + 8 + 16) + SMALL_COMMANDS
          + REBUILD[method] * LAYERS_ON_B * GRAPH_BYTES_PER_LAYER)
    down = row_bytes * (1 + (features_on_b if method == "dflash" else 0))
    waits = 1 + (features_on_b if method == "dflash" else 0) + ALLOC_WAITS[method]
    compute = 2 * WEIGHTS_PER_HOST / HBM + PER_ROW * (rows - 1) + (DRAFT if method == "dflash" else 0.0)
    link = (up + down) * 8 / (gbit * 1e9) + waits * rtt
    return {"seconds": compute + link, "compute": compute, "link": link, "bytes": up + down, "waits": waits}


def main() -> None:
    print("| link | target-only ms/step (link ms) | tok/s | DFlash 8 rows ms/step (link ms, MB) | "
          "break-even tokens/step |")
    print("|---|---|---|---|---|")
    for gbit, rtt in LINKS:
        base = step(1, "none", gbit, rtt)
        spec = step(8, "dflash", gbit, rtt)
        print(f"| {gbit} Gbit/s, {rtt * 1e3:g} ms | {base['seconds'] * 1e3:.1f} ({base['link'] * 1e3:.2f}) | "
              f"{1 / base['seconds']:.1f} | {spec['seconds'] * 1e3:.1f} ({spec['link'] * 1e3:.2f}, "
              f"{spec['bytes'] / 1e6:.2f}) | {spec['seconds'] / base['seconds']:.2f} |")
    print()
    header = " | ".join(f"{g} Gbit/s {r * 1e3:g} ms" for g, r in LINKS)
    print(f"| DFlash case (tokens/step) | {header} |")
    print("|---|" + "---|" * len(LINKS))
    for label, draft_max, tau in CASES:
        cells = []
        for gbit, rtt in LINKS:
            base = step(1, "none", gbit, rtt)["seconds"]
            spec = step(draft_max + 1, "dflash", gbit, rtt)["seconds"]
            cells.append(f"{tau / spec:.0f} tok/s, {tau * base / spec:.2f}x")
        print(f"| {label} ({tau}) | " + " | ".join(cells) + " |")
    print()
    print("| draft feature layers on B | " + " | ".join(f"{g} Gbit/s {r * 1e3:g} ms" for g, r in LINKS) + " |")
    print("|---|" + "---|" * len(LINKS))
    for feats in (0, 3, 5):
        cells = []
        for gbit, rtt in LINKS:
            base = step(1, "none", gbit, rtt)["seconds"]
            spec = step(8, "dflash", gbit, rtt, feats)
            cells.append(f"{4.68 * base / spec['seconds']:.2f}x ({spec['waits'] / 4.68:.2f} RTT/token)")
        print(f"| {feats} (greedy text, 4.68 tokens/step) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
