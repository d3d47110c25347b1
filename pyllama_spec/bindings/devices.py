"""Where a model's layers go: this machine's devices, and remote ones reached over ggml RPC.

llama.cpp's own engine does the work. ``ggml_backend_rpc_add_server`` (reached through the RPC
registry's proc address, as llama.cpp's ``common/arg.cpp`` does) gives the devices that a
``ggml-rpc-server`` offers; ``llama_model_params`` lists the devices a model spreads its layers
over, with ``split_mode``, ``tensor_split`` and ``main_gpu``. This module

* checks those options before anything native runs (host:port syntax, proportions, names,
  a split mode the devices can do) and says what is wrong;
* reaches each server first with the RPC handshake of its own, over a socket with a timeout:
  ggml's client aborts the process on a server that is down, and waits without end on one that
  is busy with another client (a server serves one client at a time);
* keeps the device pointers: above this module devices are names and ``DeviceInfo`` records.

Remote devices are not added to ggml's global registry (llama.cpp's ``--rpc`` adds them), so a
load without ``rpc_servers`` never picks up a server that another load reached, and a projector
never lands on one. With ``patches/0003`` a lost connection does not abort the process either:
ggml's client fails its commands from then on and says so (``connection_lost``), and every
decode of a model on that server checks it (``check_connections``) and raises
``RemoteDeviceError`` naming the server.

>>> from pyllama_spec.bindings import devices                                  # doctest: +SKIP
>>> [d.name for d in devices.rpc_devices("127.0.0.1:50052")]
['RPC0']
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import socket
import struct
import threading
from typing import Iterable

import numpy as np

from pyllama_spec._native import ffi, lib
from pyllama_spec.errors import (
    RemoteDeviceError,
    forget_native_problems,
    with_native_log,
)

#: ggml-rpc.h at the pin: RPC_PROTO_MAJOR_VERSION / MINOR (a server must speak the same major,
#: a minor no newer than the client's), GGML_RPC_MAX_SERVERS, and the HELLO command's number.
RPC_PROTO_MAJOR, RPC_PROTO_MINOR = 7, 0
RPC_MAX_SERVERS = 16
_RPC_CMD_HELLO = 14
_RPC_CONN_CAPS = 24  # bytes of transport capabilities in the HELLO request and answer
#: Seconds a server may take to accept the connection, and then to answer the handshake.
RPC_HANDSHAKE_TIMEOUT = 5.0

#: llama.cpp's -sm names. "tensor" (a meta device, EXPERIMENTAL at this pin) is not offered.
SPLIT_MODES = {"none": lib.LLAMA_SPLIT_MODE_NONE, "layer": lib.LLAMA_SPLIT_MODE_LAYER,
               "row": lib.LLAMA_SPLIT_MODE_ROW}
_KINDS = {lib.GGML_BACKEND_DEVICE_TYPE_CPU: "cpu", lib.GGML_BACKEND_DEVICE_TYPE_GPU: "gpu",
          lib.GGML_BACKEND_DEVICE_TYPE_IGPU: "igpu", lib.GGML_BACKEND_DEVICE_TYPE_ACCEL: "accel"}
# The target tensors a DFlash draft computes with (its token embedding and output head), kept
# on this machine's CPU when the head would land on a device the draft's context cannot use.
_HEAD_PATTERN = rb"^(output|token_embd)\.weight$"
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.\-_]*[A-Za-z0-9])?$")


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """One device as llama.cpp sees it; ``endpoint`` is the RPC server's host:port for a remote one."""

    name: str
    description: str
    kind: str  # "cpu", "gpu", "igpu", "accel" (ggml's types; a remote device reports "gpu")
    free: int  # bytes
    total: int
    endpoint: str | None = None


class Device:
    """A ggml device handle (the pointer stays in this module and bindings/model.py)."""

    def __init__(self, ptr, endpoint: str | None = None) -> None:
        self._ptr = ptr
        self.endpoint = endpoint
        self.name = ffi.string(lib.ggml_backend_dev_name(ptr)).decode()
        self.kind = _KINDS.get(lib.ggml_backend_dev_type(ptr), "other")

    def info(self) -> DeviceInfo:
        """Name, description and memory now (for a remote device: a round trip to its server)."""
        free, total = ffi.new("size_t *"), ffi.new("size_t *")
        lib.ggml_backend_dev_memory(self._ptr, free, total)
        return DeviceInfo(self.name, ffi.string(lib.ggml_backend_dev_description(self._ptr)).decode(), self.kind,
                          int(free[0]), int(total[0]), self.endpoint)

    @property
    def splits_rows(self) -> bool:
        """Whether the device's backend can split a tensor by rows (-sm row): CUDA, SYCL."""
        reg = lib.ggml_backend_dev_backend_reg(self._ptr)
        return reg != ffi.NULL and lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_split_buffer_type") \
            != ffi.NULL

    def __repr__(self) -> str:
        return f"Device({self.name!r}" + (f", endpoint={self.endpoint!r})" if self.endpoint else ")")


# --------------------------------------------------------------------------- parsing (pure Python)


def parse_endpoint(text: str) -> str:
    """An RPC server's ``host:port`` (IPv4 address or host name), normalized; ValueError otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"an RPC server is a 'host:port' string, got {text!r}")
    s = text.strip()
    if "://" in s:
        raise ValueError(f"RPC server {text!r}: give host:port without a scheme (e.g. 192.168.1.10:50052)")
    host, sep, port = s.rpartition(":")
    if not sep or not host or not port:
        raise ValueError(f"RPC server {text!r} is not host:port (e.g. 192.168.1.10:50052)")
    if ":" in host or host.startswith("["):
        raise ValueError(f"RPC server {text!r}: ggml's RPC client speaks IPv4 only; give an IPv4 address or a "
                         "host name")
    if not _HOST.match(host):
        raise ValueError(f"RPC server {text!r}: {host!r} is not a host name or IPv4 address")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"RPC server {text!r}: the port must be a number from 1 to 65535, got {port!r}")
    return f"{host}:{int(port)}"


def _as_items(value, what: str) -> list:
    """A comma-separated string (as on llama.cpp's command line) or a sequence, as a list."""
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",")] if value.strip() else []
    if isinstance(value, (bytes, dict)) or not isinstance(value, Iterable):
        raise ValueError(f"{what} must be a list (or a comma-separated string), got {value!r}")
    return list(value)


def parse_rpc_servers(value) -> tuple[str, ...]:
    """``rpc_servers``: host:port endpoints, at most 16, none twice."""
    servers = tuple(parse_endpoint(v) for v in _as_items(value, "rpc_servers"))
    twice = [e for e, n in collections.Counter(servers).items() if n > 1]
    if twice:
        raise ValueError(f"rpc_servers names {twice[0]} more than once")
    if len(servers) > RPC_MAX_SERVERS:
        raise ValueError(f"ggml's RPC client takes at most {RPC_MAX_SERVERS} servers, got {len(servers)}")
    return servers


def parse_tensor_split(value) -> tuple[float, ...]:
    """``tensor_split``: a proportion per device (llama.cpp's -ts "3,1" or "3/1"), finite and >= 0."""
    if isinstance(value, str):
        items = [v for v in re.split(r"[,/]", value)] if value.strip() else []
    else:
        items = _as_items(value, "tensor_split")
    out = []
    for v in items:
        if isinstance(v, bool):
            raise ValueError(f"tensor_split takes numbers, got {v!r}")
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"tensor_split takes numbers (proportions per device, e.g. 3,1), got {v!r}") from None
        if not math.isfinite(x) or x < 0:
            raise ValueError(f"tensor_split proportions must be finite and >= 0, got {v!r}")
        out.append(x)
    if out and not any(out):
        raise ValueError("tensor_split is all zeros: give at least one positive proportion (or none, to split "
                         "by free memory)")
    if len(out) > lib.llama_max_devices():
        raise ValueError(f"tensor_split has {len(out)} proportions; llama.cpp takes at most "
                         f"{lib.llama_max_devices()} devices")
    return tuple(out)


def parse_split_mode(value) -> str:
    """``split_mode``: llama.cpp's "none", "layer" (the default) or "row"."""
    if value == "tensor":
        raise ValueError("split_mode 'tensor' (a meta device, experimental in llama.cpp at this pin) is not "
                         "offered; use 'layer' (or 'row' on devices that split rows)")
    if value not in SPLIT_MODES:
        raise ValueError(f"split_mode must be one of {', '.join(SPLIT_MODES)}, got {value!r}")
    return value


def parse_device_names(value, what: str) -> tuple[str, ...] | None:
    """``devices`` / ``device_draft``: device names (llama.cpp's -dev), "none" for no offload, None: default."""
    if value is None:
        return None
    names = _as_items(value, what)
    if not names:
        raise ValueError(f"{what} is empty: give device names (see `pyllama-spec doctor`), or 'none'")
    for n in names:
        if not isinstance(n, str) or not n:
            raise ValueError(f"{what} takes device names, got {n!r}")
    if "none" in names:
        if len(names) > 1:
            raise ValueError(f"{what}: 'none' (no offload) cannot be combined with device names")
        return ()
    twice = [n for n, k in collections.Counter(names).items() if k > 1]
    if twice:
        raise ValueError(f"{what} names {twice[0]} more than once")
    return tuple(names)


def check_main_gpu(value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"main_gpu must be a device index >= 0, got {value!r}")
    return int(value)


# --------------------------------------------------------------------------- RPC servers


# endpoint -> open models whose devices are on that server: their connection (one per endpoint
# and process, shared by all of them) is in use, and the server would not answer a second one.
_in_use: collections.Counter[str] = collections.Counter()
_in_use_lock = threading.Lock()


def _rpc_proc(name: str, ctype: str):
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    if reg == ffi.NULL:
        raise RemoteDeviceError("this build has no RPC backend: rebuild with `python build.py --rpc` (or "
                                "CMAKE_ARGS=-DGGML_RPC=ON pip install .)")
    ptr = lib.ggml_backend_reg_get_proc_address(reg, name.encode())
    return None if ptr == ffi.NULL else ffi.cast(ctype, ptr)


def rpc_available() -> bool:
    """Whether this build has ggml's RPC backend."""
    return lib.ggml_backend_reg_by_name(b"RPC") != ffi.NULL


def loss_detectable() -> bool:
    """Whether this build's RPC client reports a lost connection (patches/0003) instead of aborting."""
    return rpc_available() and _rpc_proc("ggml_backend_rpc_connection_lost", "bool (*)(const char *)") is not None


def connection_lost(endpoint: str) -> bool | None:
    """True when the latest connection to the server failed or was lost; None if this build cannot tell."""
    fn = _rpc_proc("ggml_backend_rpc_connection_lost", "bool (*)(const char *)")
    return None if fn is None else bool(fn(endpoint.encode()))


def check_connections(endpoints: Iterable[str]) -> None:
    """Raise RemoteDeviceError for the first of these servers whose connection was lost."""
    for e in endpoints:
        if connection_lost(e):
            raise RemoteDeviceError(
                f"the connection to RPC server {e} was lost (the server stopped, or the network to it failed): "
                "the layers on it are gone, so this model cannot go on. Close the engine and load it again "
                "once the server is back", endpoint=e)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        piece = sock.recv(n - len(data))
        if not piece:
            raise ConnectionError("closed")
        data += piece
    return data


def probe_rpc_server(endpoint: str, timeout: float | None = None) -> tuple[int, int, int]:
    """Reach a server with ggml RPC's handshake (HELLO) over a socket with a timeout; its protocol version.

    Raises RemoteDeviceError naming the server when it cannot be resolved or reached, when it does
    not answer in time (ggml-rpc-server serves one client at a time), or speaks another protocol.
    """
    timeout = RPC_HANDSHAKE_TIMEOUT if timeout is None else timeout
    host, port = endpoint.rsplit(":", 1)
    try:  # IPv4, as ggml's client (gethostbyname, AF_INET)
        addr = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)[0][4]
    except socket.gaierror as e:
        raise RemoteDeviceError(f"RPC server {endpoint}: cannot resolve {host!r} to an IPv4 address ({e})",
                                endpoint=endpoint) from None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(addr)
        except socket.timeout:
            raise RemoteDeviceError(f"RPC server {endpoint} did not accept a connection within {timeout:g} s",
                                    endpoint=endpoint) from None
        except OSError as e:
            raise RemoteDeviceError(f"cannot connect to RPC server {endpoint}: {e.strerror or e} (is "
                                    "ggml-rpc-server running there, listening on that address and port?)",
                                    endpoint=endpoint) from None
        try:
            sock.sendall(struct.pack("<BQ", _RPC_CMD_HELLO, _RPC_CONN_CAPS) + bytes(_RPC_CONN_CAPS))
            (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
            answer = _recv_exact(sock, size) if size == 4 + _RPC_CONN_CAPS else b""
        except socket.timeout:
            raise RemoteDeviceError(
                f"RPC server {endpoint} accepted the connection but did not answer the handshake within "
                f"{timeout:g} s: ggml-rpc-server serves one client at a time, so another client (another "
                "process) is probably using it", endpoint=endpoint) from None
        except OSError as e:  # ConnectionError included: closed during the handshake
            raise RemoteDeviceError(f"RPC server {endpoint} closed the connection during the handshake ({e}): is it "
                                    "a ggml-rpc-server of this protocol version?", endpoint=endpoint) from None
    finally:
        sock.close()
    if not answer:
        raise RemoteDeviceError(f"RPC server {endpoint} answered the handshake with {size} bytes, not "
                                f"{4 + _RPC_CONN_CAPS}: not a ggml-rpc-server of protocol {RPC_PROTO_MAJOR}.x",
                                endpoint=endpoint)
    major, minor, patch = answer[0], answer[1], answer[2]
    if major != RPC_PROTO_MAJOR or minor > RPC_PROTO_MINOR:
        raise RemoteDeviceError(f"RPC server {endpoint} speaks protocol {major}.{minor}.{patch}, this build "
                                f"{RPC_PROTO_MAJOR}.{RPC_PROTO_MINOR}.x: run a ggml-rpc-server built from the same "
                                "llama.cpp (`pyllama-spec rpc-server` on that host)", endpoint=endpoint)
    return major, minor, patch


def rpc_devices(endpoint: str, timeout: float | None = None) -> list[Device]:
    """The devices an RPC server offers (reached first with ``probe_rpc_server``)."""
    endpoint = parse_endpoint(endpoint)
    add = _rpc_proc("ggml_backend_rpc_add_server", "ggml_backend_reg_t (*)(const char *)")
    if add is None:
        raise RemoteDeviceError("this build's RPC backend has no ggml_backend_rpc_add_server")
    with _in_use_lock:
        in_use = _in_use[endpoint] > 0
    if in_use:
        # this process is connected already (an open model on that server): no second connection
        check_connections([endpoint])
    else:
        # ggml's client would abort on a server that is not there (unpatched), wait without end on one
        # that is busy, and fail without a reason on one of another protocol
        probe_rpc_server(endpoint, timeout)
    forget_native_problems()
    reg = add(endpoint.encode())
    if reg == ffi.NULL or connection_lost(endpoint):
        raise RemoteDeviceError(with_native_log(f"RPC server {endpoint} answered the handshake but offers no "
                                                "device"), endpoint=endpoint)
    return [Device(lib.ggml_backend_reg_dev_get(reg, i), endpoint) for i in range(lib.ggml_backend_reg_dev_count(reg))]


def local_devices() -> list[Device]:
    """This machine's devices, as ggml registered them (the CPU included)."""
    return [Device(lib.ggml_backend_dev_get(i)) for i in range(lib.ggml_backend_dev_count())]


def _default_offload(local: list[Device]) -> list[Device]:
    """llama.cpp's choice when no devices are named: the GPUs, else the integrated GPUs."""
    gpus = [d for d in local if d.kind == "gpu"]
    return gpus or [d for d in local if d.kind == "igpu"]


# --------------------------------------------------------------------------- placements


@dataclasses.dataclass
class Placement:
    """One model's devices and split, as llama_model_params takes them.

    ``devices`` None: llama.cpp's own choice (every registered device, i.e. this machine's).
    ``keep_head_local``: the output head and token embedding stay on this machine's CPU.
    """

    devices: list[Device] | None = None
    split_mode: str = "layer"
    main_gpu: int = 0
    tensor_split: tuple[float, ...] = ()
    keep_head_local: bool = False

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(d.endpoint for d in self.devices or () if d.endpoint))

    @property
    def device_names(self) -> list[str] | None:
        return None if self.devices is None else [d.name for d in self.devices]

    def apply(self, params) -> list:
        """Fill llama_model_params; returns the native arrays that must live as long as the load."""
        keep: list = []
        params.split_mode = SPLIT_MODES[self.split_mode]
        params.main_gpu = self.main_gpu
        if self.devices is not None:
            arr = ffi.new("ggml_backend_dev_t[]", len(self.devices) + 1)  # NULL-terminated
            for i, d in enumerate(self.devices):
                arr[i] = d._ptr
            params.devices = arr
            keep.append(arr)
        if self.tensor_split:
            ts = ffi.new("float[]", lib.llama_max_devices())
            for i, x in enumerate(self.tensor_split):
                ts[i] = x
            params.tensor_split = ts
            keep.append(ts)
        if self.keep_head_local:
            pattern = ffi.new("char[]", _HEAD_PATTERN)
            overrides = ffi.new("struct llama_model_tensor_buft_override[]", 2)  # {NULL, NULL} ends the list
            overrides[0].pattern = pattern
            overrides[0].buft = lib.ggml_backend_cpu_buffer_type()
            params.tensor_buft_overrides = overrides
            keep += [pattern, overrides]
        return keep

    def acquire(self) -> None:
        """A model on these devices was loaded: its servers' connection is in use."""
        with _in_use_lock:
            _in_use.update(self.endpoints)

    def release(self) -> None:
        with _in_use_lock:
            _in_use.subtract(self.endpoints)
            for e in self.endpoints:
                if _in_use[e] <= 0:
                    del _in_use[e]

    def head_device(self, n_layer: int, n_gpu_layers: int) -> Device | None:
        """The device llama.cpp puts the output head on (None: the CPU), as llama-model.cpp's
        load_tensors assigns layer n_layer; needs the devices' free memory without a tensor_split."""
        devices = self.devices if self.devices is not None else _default_offload(local_devices())
        if not devices or n_gpu_layers == 0:
            return None
        if self.split_mode == "none":
            return devices[self.main_gpu] if self.main_gpu < len(devices) else None
        ngl = n_layer + 1 if n_gpu_layers < 0 else n_gpu_layers
        act = min(ngl, n_layer + 1)
        start = max(n_layer + 1 - ngl, 0)
        shares = (list(self.tensor_split) + [0.0] * len(devices))[:len(devices)] if self.tensor_split else \
            [float(d.info().free) for d in devices]
        cum = np.cumsum(np.asarray(shares, dtype=np.float32))
        if cum[-1] <= 0:
            return devices[-1]
        cum /= cum[-1]
        x = np.float32(n_layer - start) / np.float32(act)
        return devices[min(int(np.searchsorted(cum, x, side="right")), len(devices) - 1)]


@dataclasses.dataclass
class EnginePlacement:
    """Where the target and the draft of one engine go."""

    target: Placement
    draft: Placement

    def memory_budget(self, n_gpu_layers: int) -> tuple[str, int] | None:
        """(device label, free bytes) that a load's memory estimate must fit, or None when unknown.

        One device when nothing is split (the first GPU with layers offloaded, else the CPU); with
        named or remote devices, the free memory of every device the load may use, the CPU's included.
        """
        local = local_devices()
        cpu = next((d for d in local if d.kind == "cpu"), None)
        if self.target.devices is None and self.draft.devices is None:
            gpus = [d for d in local if d.kind != "cpu"]
            device = gpus[0] if (n_gpu_layers != 0 and gpus) else cpu
            return None if device is None else (device.name, device.info().free)
        used: dict[str, Device] = {}
        for d in [*(self.target.devices or _default_offload(local)), *(self.draft.devices or ()),
                  *([cpu] if cpu else [])]:
            used.setdefault(d.name, d)
        return " + ".join(used), sum(d.info().free for d in used.values())


def plan(config, *, draft_uses_target_head: bool = False) -> EnginePlacement:
    """Check an EngineConfig's device options and reach its RPC servers; where target and draft go.

    ``draft_uses_target_head``: the speculative method's draft computes with the target's output
    head (the drafter registry says so), which must then stay where the draft's context can use it.

    Everything that can be checked without native calls is checked first (ValueError); then each
    RPC server is reached (RemoteDeviceError naming it); then device names are resolved.
    """
    from pyllama_spec.gguf.reader import read_gguf_shared

    servers = parse_rpc_servers(config.rpc_servers)
    names = parse_device_names(config.devices, "devices")
    draft_names = parse_device_names(config.device_draft, "device_draft")
    split_mode = parse_split_mode(config.split_mode)
    tensor_split = parse_tensor_split(config.tensor_split)
    main_gpu = check_main_gpu(config.main_gpu)
    if servers and config.n_gpu_layers == 0:
        raise ValueError("rpc_servers are given but n_gpu_layers is 0, which keeps every layer on this machine: "
                         "set n_gpu_layers (-ngl), e.g. 99 for all layers, or fewer to keep the first ones here")
    if not (servers or names is not None or draft_names is not None or tensor_split or split_mode != "layer"
            or main_gpu):
        return EnginePlacement(Placement(), Placement())  # llama.cpp's defaults: nothing to resolve
    remote: list[Device] = []
    for e in servers:
        remote += rpc_devices(e)
    local = local_devices()
    offered = {d.name: d for d in [*remote, *local]}

    def resolve(wanted: tuple[str, ...], what: str) -> list[Device]:
        out = []
        for n in wanted:
            d = offered.get(n)
            if d is None:
                listed = ", ".join(f"{k}" + (f" ({v.endpoint})" if v.endpoint else "")
                                   for k, v in offered.items() if v.kind != "cpu") or "none"
                raise ValueError(f"{what}: unknown device {n!r}; devices here: {listed} (remote ones come with "
                                 "rpc_servers / --rpc; `pyllama-spec doctor --rpc HOST:PORT` lists them)")
            if d.kind == "cpu":
                raise ValueError(f"{what}: {n} is the CPU, which is not a device to offload to: the layers that "
                                 "n_gpu_layers does not offload stay on it")
            out.append(d)
        return out

    if names is not None:
        target_devices = resolve(names, "devices")
    elif servers:
        target_devices = remote + _default_offload(local)  # llama.cpp's order: remote first, then local
    else:
        target_devices = None
    draft_devices = resolve(draft_names, "device_draft") if draft_names is not None else None
    in_use = target_devices if target_devices is not None else _default_offload(local)
    if tensor_split and len(tensor_split) > len(in_use):
        raise ValueError(f"tensor_split has {len(tensor_split)} proportions but the target is split over "
                         f"{len(in_use)} device(s)" + (f" ({', '.join(d.name for d in in_use)})" if in_use else ""))
    if split_mode in ("none", "row") and in_use and main_gpu >= len(in_use):
        raise ValueError(f"main_gpu {main_gpu} is not one of the target's {len(in_use)} device(s) "
                         f"({', '.join(d.name for d in in_use)}): give an index from 0 to {len(in_use) - 1}")
    if split_mode == "row":
        for d in in_use:
            if not d.splits_rows:
                raise ValueError(f"split_mode 'row' needs devices that split a tensor by rows (CUDA, SYCL); {d.name} "
                                 f"({d.endpoint or d.kind}) does not: use 'layer'")
    target = Placement(target_devices, split_mode, main_gpu, tensor_split)
    draft = Placement(draft_devices)
    if draft_uses_target_head and config.draft is not None and config.n_gpu_layers != 0 \
            and "output.weight" not in read_gguf_shared(config.draft).tensors:
        # A draft such as DFlash's computes with the target's token embedding (on the CPU) and output head.
        # Its context has the draft's devices only: a head elsewhere (on a server) could not be used.
        info = read_gguf_shared(config.model)
        n_layer = int(info.metadata.get(f"{info.arch}.block_count", 0) or 0)
        head = target.head_device(n_layer, config.n_gpu_layers)
        reachable = {d.name for d in (draft_devices if draft_devices is not None else local)}
        target.keep_head_local = head is not None and head.name not in reachable
    return EnginePlacement(target, draft)
