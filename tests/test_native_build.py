"""The build logic that needs no compiler run: backends' toolchain checks, cache keys, patches, records."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# build.py by path: `import build` could find PyPA's `build` package instead.
_spec = importlib.util.spec_from_file_location("pyllama_build_script", REPO / "build.py")
build_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_script)
nb = build_script.load_native_build()


@pytest.fixture
def no_tools(monkeypatch, tmp_path):
    """A PATH with nothing on it, so every toolchain lookup misses."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDACXX", raising=False)
    monkeypatch.delenv("VULKAN_SDK", raising=False)
    monkeypatch.delenv("PYLLAMA_CUBLAS_DIR", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))


@pytest.mark.parametrize("backend,needle", [
    ("cuda", "nvcc"), ("rocm", "hipcc"), ("vulkan", "glslc"), ("metal", "macOS"),
])
def test_a_backend_without_its_toolchain_fails_naming_what_is_missing(no_tools, backend, needle):
    with pytest.raises(nb.BuildError, match=needle):
        nb.backend_cmake_args(nb.BuildOptions(backend=backend))


@pytest.fixture
def fake_nvcc(monkeypatch, tmp_path) -> Path:
    """A CUDA 'toolkit' holding only an nvcc (no cuBLAS, no driver stub), found through CUDACXX."""
    toolkit = tmp_path / "cuda"
    (toolkit / "bin").mkdir(parents=True)
    nvcc = toolkit / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDACXX", str(nvcc))
    return nvcc


def test_cuda_without_cublas_says_where_to_get_it(fake_nvcc, monkeypatch, tmp_path):
    monkeypatch.setattr(nb.backends.sys, "path", [])  # no nvidia-cublas wheel either (backends reads sys.path)
    with pytest.raises(nb.BuildError, match="nvidia-cublas.*--cublas-dir"):
        nb.backend_cmake_args(nb.BuildOptions(backend="cuda", cublas_dir=str(tmp_path / "empty")))


def test_cuda_finds_a_cublas_outside_the_toolkit_and_links_unversioned_names(fake_nvcc, monkeypatch, tmp_path):
    wheel_lib = tmp_path / "site" / "nvidia" / "cu13" / "lib"
    wheel_lib.mkdir(parents=True)
    (wheel_lib / "libcublas.so.13").write_bytes(b"")
    (wheel_lib / "libcublasLt.so.13").write_bytes(b"")
    monkeypatch.setenv("PYLLAMA_SPEC_CACHE", str(tmp_path / "cache"))
    args = nb.backend_cmake_args(nb.BuildOptions(backend="cuda", cublas_dir=str(wheel_lib), cuda_arch="90"))
    assert "-DGGML_CUDA=ON" in args and "-DCMAKE_CUDA_ARCHITECTURES=90" in args
    assert "-DGGML_CUDA_NO_VMM=ON" in args  # no driver stub in this toolkit
    lib = Path(next(a for a in args if a.startswith("-DCUDA_cublas_LIBRARY=")).split("=", 1)[1])
    assert lib.name == "libcublas.so" and lib.resolve() == (wheel_lib / "libcublas.so.13").resolve()


def test_cmake_args_select_the_backend_as_llama_cpp_python_users_type_them():
    assert nb.backend_from_cmake_args("-DGGML_CUDA=on") == "cuda"
    assert nb.backend_from_cmake_args("-DGGML_VULKAN=ON -DFOO=1") == "vulkan"
    assert nb.backend_from_cmake_args("-DGGML_CUDA=off") == "cpu"
    assert nb.backend_from_cmake_args("") == "cpu"


def test_the_build_key_changes_with_backend_flags_and_source():
    src = nb.Source(Path("/x"), "pinned", "pinned:abc", ())
    project = Path("/cache/project/0123")
    base = nb.build_key(src, nb.BuildOptions(), [], project)
    assert base == nb.build_key(src, nb.BuildOptions(), [], project)
    assert base != nb.build_key(src, nb.BuildOptions(backend="cuda"), [], project)
    assert base != nb.build_key(src, nb.BuildOptions(), ["-DGGML_NATIVE=OFF"], project)
    assert base != nb.build_key(nb.Source(Path("/x"), "pinned", "pinned:abd", ()), nb.BuildOptions(), [], project)


def test_patches_apply_once_and_are_recognised_when_already_applied(tmp_path):
    tree = tmp_path / "tree"
    (tree / "src").mkdir(parents=True)
    (tree / "src" / "a.cpp").write_text("int main() {\n    return 0;\n}\n")
    patch = tmp_path / "0001-example.patch"
    patch.write_text("example: why this patch exists\n"
                     "--- a/src/a.cpp\n+++ b/src/a.cpp\n@@ -1,3 +1,4 @@\n int main() {\n+    int x = 1;\n"
                     "     return 0;\n }\n")
    nb.source._apply_patches(tree, [patch])
    nb.source._apply_patches(tree, [patch])  # idempotent
    assert (tree / "src" / "a.cpp").read_text().count("int x = 1;") == 1
    (tree / "src" / "a.cpp").write_text("something else\n")
    with pytest.raises(nb.BuildError, match="does not apply"):
        nb.source._apply_patches(tree, [patch])


def test_user_checkout_must_have_the_dflash_headers(tmp_path):
    with pytest.raises(nb.BuildError, match="llama-ext.h"):
        nb.user_source(tmp_path)


def test_installed_libraries_are_one_copy_each_under_their_soname(tmp_path):
    real = tmp_path / "libllama.so.0.5.0"
    real.write_bytes(b"x")
    (tmp_path / "libllama.so.0").symlink_to(real.name)
    (tmp_path / "libllama.so").symlink_to("libllama.so.0")
    (tmp_path / "libpyllama_shim.so").write_bytes(b"y")
    chosen = nb.shared_libraries(tmp_path)
    assert sorted(chosen) == ["libllama.so.0", "libpyllama_shim.so"]


def test_dflash_capable_archs_are_read_from_the_built_source():
    from pyllama_spec.bindings.native_info import build_record

    record = build_record()
    source = Path(record["source"]["path"])
    if not source.exists():
        pytest.skip(f"the source this build was made from is gone ({source})")
    archs = nb.dflash_capable_archs(source)
    assert {"hunyuan_vl", "qwen35", "qwen3"} <= set(archs)
    assert ({"qwen2vl", "qwen3vl", "qwen3vlmoe"} <= set(archs)) == bool(record["patches"])


def test_an_unpatched_tree_is_recorded_as_unable_to_feed_dflash_from_qwen_vl(tmp_path):
    """What the engine's load check reads for a user's own (unpatched) checkout."""
    from pyllama_spec.bindings.native_info import build_record

    source = Path(build_record()["source"]["path"])
    if not source.exists():
        pytest.skip(f"the source this build was made from is gone ({source})")
    tree = tmp_path / "tree"
    (tree / "src" / "models").mkdir(parents=True)
    for name in ("llama-model.cpp", "llama-arch.cpp"):
        (tree / "src" / name).write_bytes((source / "src" / name).read_bytes())
    for f in (source / "src" / "models").glob("*.cpp"):
        (tree / "src" / "models" / f.name).write_bytes(f.read_bytes())
    patch = nb.PATCHES_DIR / "0001-record-layer-inputs-qwen-vl.patch"
    if "0001-record-layer-inputs-qwen-vl.patch" in build_record()["patches"]:
        subprocess.run(["git", "apply", "--reverse", str(patch)], cwd=tree, check=True,
                       env={"GIT_CEILING_DIRECTORIES": str(tmp_path), "PATH": "/usr/bin:/bin"})
    unpatched = set(nb.dflash_capable_archs(tree))
    assert "hunyuan_vl" in unpatched and not {"qwen2vl", "qwen3vl", "qwen3vlmoe"} & unpatched
    nb.source._apply_patches(tree, [patch])
    assert {"qwen2vl", "qwen3vl", "qwen3vlmoe"} <= set(nb.dflash_capable_archs(tree))


def test_build_script_help_lists_the_backends():
    out = subprocess.run(["python3", str(nb.PROJECT_ROOT / "build.py"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--cuda", "--rocm", "--vulkan", "--metal", "--llama-cpp", "--cublas-dir", "--tools", "--rpc",
                 "--no-rpc"):
        assert flag in out.stdout


def test_rpc_is_part_of_every_build_unless_turned_off_and_cmake_args_have_the_last_word(monkeypatch):
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    assert nb.rpc_wanted(nb.BuildOptions()) and nb.feature_cmake_args(nb.BuildOptions()) == ["-DGGML_RPC=ON"]
    assert not nb.rpc_wanted(nb.BuildOptions(rpc=False)) and nb.feature_cmake_args(nb.BuildOptions(rpc=False)) == []
    assert not nb.rpc_wanted(nb.BuildOptions(cmake_args=("-DGGML_RPC=OFF",)))
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_CUDA=on -DGGML_RPC=ON")
    assert nb.rpc_wanted(nb.BuildOptions(rpc=False))
    assert nb.parse_args(["--no-rpc"]).rpc is False and nb.parse_args([]).rpc is True


def test_the_installed_build_records_rpc_and_carries_its_server():
    from pyllama_spec.bindings import native_info

    record = native_info.build_record()
    if not record.get("rpc"):
        pytest.skip("this build was made without RPC (--no-rpc)")
    assert "-DGGML_RPC=ON" in record["cmake_args"] or "GGML_RPC" in " ".join(record["cmake_args"])
    assert native_info.RPC_SERVER_PATH.is_file()
    out = subprocess.run([str(native_info.RPC_SERVER_PATH), "--help"], capture_output=True, text=True, timeout=30)
    assert "--host" in out.stderr + out.stdout and "--port" in out.stderr + out.stdout


def _movable_tools(dest: Path) -> "nb.BuildTools | None":
    """Copies of this machine's cmake and ninja binaries under ``dest`` (cmake finds its modules
    beside itself), as pip's temporary build environment has them: usable until ``dest`` goes."""
    import shutil

    cmake, ninja = shutil.which("cmake"), shutil.which("ninja")
    if not cmake or not ninja:
        return None
    cmake_real, ninja_real = Path(cmake).resolve(), Path(ninja).resolve()
    shares = sorted(cmake_real.parent.parent.glob("share/cmake-*"))
    if not shares or cmake_real.read_bytes()[:4] != b"\x7fELF" or ninja_real.read_bytes()[:4] != b"\x7fELF":
        return None  # e.g. the pip wheels' launcher scripts: not copyable this way
    (dest / "bin").mkdir(parents=True)
    (dest / "share").mkdir()
    shutil.copy2(cmake_real, dest / "bin" / "cmake")
    shutil.copy2(ninja_real, dest / "bin" / "ninja")
    for share in shares:
        (dest / "share" / share.name).symlink_to(share)
    return nb.BuildTools(str(dest / "bin" / "cmake"), str(dest / "bin" / "ninja"))


def _tiny_cmake_project(tmp_path: Path) -> Path:
    """A CMake project of one C file (target "thing")."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.21)\nproject(p C)\n"
                                            "add_library(thing SHARED thing.c)\n")
    (project / "thing.c").write_text("int thing(void) { return 42; }\n")
    return project


def test_a_build_folder_outlives_the_tools_that_configured_it_and_rebuilds_nothing(tmp_path):
    """`pip install -e .` configures with pip's temporary cmake and ninja, then deletes them:
    the next install (or build.py) must configure again with the tools it has, compiling nothing."""
    import shutil

    temporary = tmp_path / "pip-build-env" / "overlay"
    tools = _movable_tools(temporary)
    if tools is None:
        pytest.skip("needs cmake and ninja binaries (not the pip wheels' launchers) to copy")
    project, build = _tiny_cmake_project(tmp_path), tmp_path / "build"

    first = nb.configure_and_build(tools, project, build, [], ["thing"], 1)
    assert first == {"thing": True}
    assert str(temporary) in (build / "CMakeCache.txt").read_text()
    shutil.rmtree(temporary.parent)  # what pip does when the install ends

    again = nb.configure_and_build(nb.BuildTools.find(), project, build, [], ["thing"], 1)
    assert again == {"thing": False}, (build / "build-thing.log").read_text()
    assert str(temporary) not in (build / "CMakeCache.txt").read_text()
    # and a third build with the same tools does not even configure again
    stamp = (build / "configure-args.json").stat().st_mtime_ns
    assert nb.configure_and_build(nb.BuildTools.find(), project, build, [], ["thing"], 1) == {"thing": False}
    assert (build / "configure-args.json").stat().st_mtime_ns == stamp


def test_a_changed_source_file_is_compiled_again(tmp_path):
    tools = nb.BuildTools.find()
    project, build = _tiny_cmake_project(tmp_path), tmp_path / "build"
    assert nb.configure_and_build(tools, project, build, [], ["thing"], 1) == {"thing": True}
    (project / "thing.c").write_text("int thing(void) { return 43; }\n")
    assert nb.configure_and_build(tools, project, build, [], ["thing"], 1) == {"thing": True}


def test_a_build_folder_copied_elsewhere_builds_again_instead_of_failing(tmp_path, capsys):
    """A copied cache folder failed with CMake's "CMakeCache.txt directory ... is different" (issue 44)."""
    import shutil

    tools = nb.BuildTools.find()
    project, build = _tiny_cmake_project(tmp_path), tmp_path / "build"
    assert nb.configure_and_build(tools, project, build, [], ["thing"], 1) == {"thing": True}
    moved = tmp_path / "moved" / "build"
    shutil.copytree(build, moved)
    assert nb.configure_and_build(tools, project, moved, [], ["thing"], 1) == {"thing": True}
    assert "was made at" in capsys.readouterr().err
    assert nb.configure_and_build(tools, project, moved, [], ["thing"], 1) == {"thing": False}


def test_a_first_build_says_what_it_takes():
    from pyllama_spec.native_build.cmake import first_build_minutes

    assert first_build_minutes("cpu", 2) == "about 3-16 minutes"
    assert first_build_minutes("cpu", 16) == "about 1-2 minutes"
    assert first_build_minutes("cuda", 2) == "about 9-48 minutes"
