"""A target split across this machine and ggml-rpc-server processes on loopback (127.0.0.1 only).

Servers come from this build (``pyllama_spec.devtools.rpc_server.LocalRPCServer``: a free port, its own
process group, a bounded lifetime, ended by the fixtures even when a test fails). Greedy output
split across the local CPU and one or two servers must be the target-only local output token for
token, with an image and with DFlash; bad options are refused before anything native runs; a
server that is down, busy, of another protocol, or killed mid-generation is a RemoteDeviceError
naming it, and the engine can still be closed.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
from click.testing import CliRunner
from conftest import TINY_ENGINE, explain_child

import pyllama_spec as ps
from pyllama_spec.bindings import devices
from pyllama_spec.devtools.rpc_server import LocalRPCServer, free_port, server_binary
from pyllama_spec.embedded import PROMPT as CODE_PROMPT

pytestmark = pytest.mark.skipif(
    server_binary() is None or not devices.rpc_available(),
    reason="this build has no RPC backend or no ggml-rpc-server (python build.py --rpc builds both)")

KW = dict(n_ctx=2048, **TINY_ENGINE, flash_attn=False)
PROMPT = f"Describe this: {ps.MEDIA_MARKER} in a few words."


@pytest.fixture
def rpc_servers():
    """start(n) -> n running LocalRPCServers; all of them are ended after the test, whatever happens."""
    started: list[LocalRPCServer] = []

    def start(n: int = 1) -> list[LocalRPCServer]:
        for _ in range(n):
            started.append(LocalRPCServer(threads=1, lifetime=600))
        return started[-n:]

    yield start
    for s in started:
        s.kill()


def _run(models, *, image=None, prompt=None, spec="dflash", max_tokens=24, **extra):
    prompt = prompt or (PROMPT if image is not None else "def f(x):\n    return")
    with ps.load(models.target, mmproj=models.mmproj, draft=models.draft if spec != "none" else None,
                 spec_type=spec, draft_max=7, **KW, **extra) as engine:
        result = engine.generate(prompt, images=[image] if image is not None else [], max_tokens=max_tokens)
        return result, engine.placement


# --------------------------------------------------------------------------- refused before anything native


@pytest.mark.parametrize("servers,needle", [
    (["localhost"], "not host:port"),
    (["127.0.0.1:0"], "port must be"),
    (["127.0.0.1:70000"], "port must be"),
    (["127.0.0.1:abc"], "port must be"),
    (["tcp://127.0.0.1:5000"], "without a scheme"),
    (["[::1]:5000"], "IPv4"),
    (["bad host:5000"], "not a host name"),
    (["127.0.0.1:5000", "127.0.0.1:5000"], "more than once"),
    ([f"127.0.0.1:{5000 + i}" for i in range(17)], "at most 16"),
])
def test_a_bad_rpc_server_list_is_refused_before_any_connection(tiny_dense, monkeypatch, servers, needle):
    monkeypatch.setattr(devices, "rpc_devices", lambda *a: pytest.fail("a server was contacted"))
    with pytest.raises(ValueError, match=needle):
        ps.load(tiny_dense.target, rpc_servers=servers, n_gpu_layers=99, **KW)


@pytest.mark.parametrize("options,needle", [
    (dict(tensor_split=[1, -1]), "finite and >= 0"),
    (dict(tensor_split=[float("nan")]), "finite and >= 0"),
    (dict(tensor_split=[0, 0]), "all zeros"),
    (dict(tensor_split="3,x"), "takes numbers"),
    (dict(tensor_split=[1.0] * 17), "at most"),
    (dict(split_mode="tensor"), "not offered"),
    (dict(split_mode="rows"), "split_mode must be one of"),
    (dict(main_gpu=-1), "main_gpu"),
    (dict(devices=[]), "is empty"),
    (dict(devices=["none", "RPC0"]), "cannot be combined"),
    (dict(devices=["RPC0", "RPC0"]), "more than once"),
    (dict(rpc_servers=["127.0.0.1:5000"], n_gpu_layers=0), "n_gpu_layers is 0"),
])
def test_bad_split_options_are_refused_before_any_connection(tiny_dense, monkeypatch, options, needle):
    monkeypatch.setattr(devices, "rpc_devices", lambda *a: pytest.fail("a server was contacted"))
    kwargs = dict(KW, n_gpu_layers=99, rpc_servers=["127.0.0.1:5000"])
    kwargs.update(options)
    with pytest.raises(ValueError, match=needle):
        ps.load(tiny_dense.target, **kwargs)


def test_unknown_device_names_and_a_split_longer_than_the_devices_are_refused(tiny_dense):
    with pytest.raises(ValueError, match="unknown device 'CUDA7'.*doctor --rpc"):
        ps.load(tiny_dense.target, devices=["CUDA7"], n_gpu_layers=99, **KW)
    with pytest.raises(ValueError, match="is the CPU"):
        ps.load(tiny_dense.target, devices=["CPU"], n_gpu_layers=99, **KW)
    with pytest.raises(ValueError, match="device_draft: unknown device"):
        ps.load(tiny_dense.target, draft=tiny_dense.draft, device_draft="GPU9", n_gpu_layers=99, **KW)


def test_the_draft_layers_setting_has_one_name_and_takes_llama_cpps_too(tiny_dense):
    with ps.load(tiny_dense.target, draft=tiny_dense.draft, n_gpu_layers_draft=0, **KW) as engine:
        assert engine.config.draft_n_gpu_layers == 0
    with pytest.raises(ValueError, match="one setting"):
        ps.load(tiny_dense.target, n_gpu_layers_draft=0, draft_n_gpu_layers=1, **KW)


def test_the_local_server_helper_binds_to_loopback_only():
    with pytest.raises(ValueError, match="loopback only"):
        LocalRPCServer(host="0.0.0.0")


def test_the_handshake_constants_match_the_built_ggml_rpc_header():
    from pathlib import Path

    from pyllama_spec.bindings.native_info import build_record

    header = Path(build_record().get("source", {}).get("path", "/nonexistent")) / "ggml/include/ggml-rpc.h"
    if not header.exists():
        pytest.skip(f"the source this build was made from is gone ({header})")
    text = header.read_text()
    assert f"#define RPC_PROTO_MAJOR_VERSION    {devices.RPC_PROTO_MAJOR}" in text
    assert f"#define RPC_PROTO_MINOR_VERSION    {devices.RPC_PROTO_MINOR}" in text
    assert f"#define GGML_RPC_MAX_SERVERS       {devices.RPC_MAX_SERVERS}" in text


# --------------------------------------------------------------------------- servers that cannot serve


def test_an_unreachable_server_is_a_clear_error_naming_it(tiny_dense):
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ps.RemoteDeviceError, match=f"cannot connect to RPC server {endpoint}.*Connection refused") \
            as info:
        ps.load(tiny_dense.target, rpc_servers=[endpoint], n_gpu_layers=99, **KW)
    assert info.value.endpoint == endpoint and isinstance(info.value, ConnectionError)
    # nothing half-made is left: a local load right after works
    with ps.load(tiny_dense.target, **KW) as engine:
        assert len(engine.generate("hello", max_tokens=4).tokens) == 4


def test_a_busy_server_is_named_instead_of_waited_for(tiny_dense, rpc_servers, monkeypatch):
    (server,) = rpc_servers(1)
    monkeypatch.setattr(devices, "RPC_HANDSHAKE_TIMEOUT", 1.0)
    other = socket.create_connection((server.host, server.port))  # another client holds the server
    try:
        other.sendall(struct.pack("<BQ", 14, 24) + bytes(24))
        other.recv(40)
        t0 = time.monotonic()
        with pytest.raises(ps.RemoteDeviceError, match="did not answer the handshake within 1 s.*another client"):
            ps.load(tiny_dense.target, rpc_servers=[server.endpoint], n_gpu_layers=99, **KW)
        assert time.monotonic() - t0 < 10
    finally:
        other.close()
    with ps.load(tiny_dense.target, rpc_servers=[server.endpoint], n_gpu_layers=99, **KW) as engine:
        assert engine.model.endpoints == (server.endpoint,)  # free again: it serves


def test_a_server_of_another_protocol_is_refused_with_its_version(tiny_dense):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def answer_as_version_6():
        conn, _ = listener.accept()
        with conn:
            conn.recv(33)
            conn.sendall(struct.pack("<Q", 28) + bytes([6, 0, 0, 0]) + bytes(24))

    t = threading.Thread(target=answer_as_version_6, daemon=True)
    t.start()
    endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        with pytest.raises(ps.RemoteDeviceError, match="speaks protocol 6.0.0, this build 7.0"):
            ps.load(tiny_dense.target, rpc_servers=[endpoint], n_gpu_layers=99, **KW)
    finally:
        t.join(5)
        listener.close()


# --------------------------------------------------------------------------- the same output, split


@pytest.mark.parametrize("n_servers", [1, 2])
def test_greedy_output_split_across_cpu_and_servers_equals_the_local_run(tiny_dense, big_image, rpc_servers,
                                                                          n_servers):
    servers = rpc_servers(n_servers)
    endpoints = [s.endpoint for s in servers]
    # 4 layers + the output head: -ngl 3 keeps layers 0-1 on this CPU, layers 2-3 and the head remote
    split = dict(rpc_servers=endpoints, n_gpu_layers=3, tensor_split=[1] * n_servers)
    for spec, image in (("none", None), ("none", big_image), ("dflash", big_image)):
        local, _ = _run(tiny_dense, spec=spec, image=image)
        remote, placement = _run(tiny_dense, spec=spec, image=image, **split)
        assert remote.tokens == local.tokens, (spec, image is not None)
        assert (remote.stats.drafted, remote.stats.accepted) == (local.stats.drafted, local.stats.accepted)
        assert placement.target.endpoints == tuple(endpoints)
        assert [d.endpoint for d in placement.target.devices] == endpoints  # one device per server
        assert placement.draft.devices is None  # the draft stays on this machine
        if spec == "dflash":
            # the DFlash draft computes with the target's head: kept here, not on a server
            assert placement.target.keep_head_local


def test_the_trained_pair_split_over_two_servers_writes_the_same_code_after_an_image(big_image, rpc_servers):
    m = ps.embedded_models()
    endpoints = [s.endpoint for s in rpc_servers(2)]
    prompt = f"{ps.MEDIA_MARKER}\n{CODE_PROMPT}"
    local, _ = _run(m, image=big_image, prompt=prompt, max_tokens=48)
    remote, _ = _run(m, image=big_image, prompt=prompt, max_tokens=48, rpc_servers=endpoints, n_gpu_layers=99)
    assert remote.text == local.text and remote.tokens == local.tokens
    assert remote.stats.accepted == local.stats.accepted > 0


def test_named_remote_devices_split_mode_none_and_main_gpu(tiny_dense, rpc_servers):
    servers = rpc_servers(2)
    names = [devices.rpc_devices(s.endpoint)[0].name for s in servers]
    local, _ = _run(tiny_dense, spec="none", prompt="def f(x):")
    # every offloaded layer on the second server only
    remote, placement = _run(tiny_dense, spec="none", prompt="def f(x):", rpc_servers=[s.endpoint for s in servers],
                             devices=list(reversed(names)), split_mode="none", main_gpu=1, n_gpu_layers=99)
    assert remote.tokens == local.tokens
    assert placement.target.device_names == list(reversed(names))
    with pytest.raises(ValueError, match="main_gpu 2 is not one of the target's 2 device"):
        ps.load(tiny_dense.target, rpc_servers=[s.endpoint for s in servers], split_mode="none", main_gpu=2,
                n_gpu_layers=99, **KW)
    with pytest.raises(ValueError, match="tensor_split has 3 proportions but the target is split over 2"):
        ps.load(tiny_dense.target, rpc_servers=[s.endpoint for s in servers], tensor_split=[1, 1, 1],
                n_gpu_layers=99, **KW)
    with pytest.raises(ValueError, match="'row' needs devices that split a tensor by rows"):
        ps.load(tiny_dense.target, rpc_servers=[s.endpoint for s in servers], split_mode="row",
                n_gpu_layers=99, **KW)


def test_two_engines_in_one_process_share_a_server(tiny_dense, rpc_servers):
    (server,) = rpc_servers(1)
    opts = dict(rpc_servers=[server.endpoint], n_gpu_layers=99, **KW)
    with ps.load(tiny_dense.target, **opts) as a, ps.load(tiny_dense.target, **opts) as b:
        assert a.generate("abc", max_tokens=8).tokens == b.generate("abc", max_tokens=8).tokens


# --------------------------------------------------------------------------- a server lost mid-generation

LOST_SERVER_CHILD = """
import sys, time
import pyllama_spec as ps
from pyllama_spec.devtools.rpc_server import LocalRPCServer
from pyllama_spec.embedded import PROMPT

m = ps.embedded_models()
with LocalRPCServer(lifetime=120) as server:
    engine = ps.load(m.target, mmproj=m.mmproj, draft=m.draft, rpc_servers=[server.endpoint], n_gpu_layers=99,
                     n_threads=1, n_ctx=2048, n_batch=64, n_ubatch=64)
    pieces, killed_at = 0, None
    try:
        for piece in engine.stream(PROMPT, max_tokens=1000):
            pieces += 1
            if pieces == 3:
                server.kill()
                killed_at = time.monotonic()
        print("NO ERROR after", pieces, "pieces")
    except ps.RemoteDeviceError as e:
        print(f"RAISED {time.monotonic() - killed_at:.3f} s after the kill, endpoint {e.endpoint == server.endpoint}")
        print("MESSAGE", e)
    try:
        engine.generate("def f():", max_tokens=4)
        print("SECOND CALL WORKED")
    except ps.RemoteDeviceError:
        print("SECOND CALL REFUSED")
    t = time.monotonic()
    engine.close()
    print(f"CLOSED in {time.monotonic() - t:.3f} s")
"""


def test_a_server_killed_mid_generation_raises_within_a_bounded_time_and_the_engine_closes(run_python):
    # in a child: were the RPC client to abort (an unpatched llama.cpp does), the test runner survives
    res = run_python(LOST_SERVER_CHILD, timeout=120)
    assert res.returncode == 0, explain_child(res)
    out = res.stdout
    assert "RAISED" in out and "endpoint True" in out, out
    seconds = float(out.split("RAISED ")[1].split(" s")[0])
    assert seconds < 10, out
    assert "was lost" in out and "SECOND CALL REFUSED" in out and "CLOSED" in out, out


# --------------------------------------------------------------------------- the command line


def test_doctor_lists_remote_devices_and_their_memory(rpc_servers):
    from pyllama_spec.cli import main

    (server,) = rpc_servers(1)
    down = f"127.0.0.1:{free_port()}"
    result = CliRunner().invoke(main, ["doctor", "--rpc", server.endpoint], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "remote devices" in result.output and server.endpoint in result.output and "GiB" in result.output
    assert "a lost server is an error" in " ".join(result.output.split())  # rich wraps the table
    result = CliRunner().invoke(main, ["doctor", "--rpc", f"{server.endpoint},{down}"], terminal_width=200)
    assert result.exit_code == 1 and "unreachable" in result.output and down in result.output


def test_generate_takes_llama_cpps_split_flags(rpc_servers):
    from pyllama_spec.cli import main

    servers = rpc_servers(2)
    args = ["generate", "-p", "def add(a, b):", "--raw", "-n", "8", "-t", "1", "-c", "1024", "--json"]
    local = CliRunner().invoke(main, args)
    split = CliRunner().invoke(main, args + ["--rpc", ",".join(s.endpoint for s in servers), "-ngl", "99",
                                            "-ts", "3,1", "-sm", "layer", "-devd", "none"])
    assert local.exit_code == 0 and split.exit_code == 0, split.output
    import json

    assert json.loads(split.stdout.splitlines()[-1])["tokens"] == json.loads(local.stdout.splitlines()[-1])["tokens"]
    bad = CliRunner().invoke(main, args + ["--rpc", "nohost", "-ngl", "99"])
    assert bad.exit_code == 1 and "not host:port" in bad.output
