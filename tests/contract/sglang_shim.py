"""Load the few SGLang 0.5.23 modules the contract test needs, without torch.

`import sglang` pulls in torch, so nothing here imports the package. Each module is executed
from its own file under the installed package, with the parent packages and the two heavy
modules it names (`runtime_context`, `cpp_extension_loader`, `mem_cache.utils`) replaced by
small stand-ins for the duration of the load only: `sys.modules` is restored afterwards.

- `load_kv_events()`: `sglang/srt/disaggregation/kv_events.py`, unmodified (event structs,
  `KVEventBatch`, `ZmqEventPublisher`, `KVEventsConfig`).
- `load_load_snapshot()`: `sglang/srt/managers/load_snapshot.py` (`LoadSnapshot`, one rank of
  `/v1/loads`).
- `load_event_recorder(build_dir)`: `sglang/srt/mem_cache/events.py` (`KVCacheEventRecorder`)
  over the real hash path: `mem_cache/cpp_utils/native_hash.py` and its C++ `hash_binding.cpp`
  compiled here with g++ + pybind11 + OpenSSL instead of torch's JIT loader, and the hash
  helpers of `mem_cache/utils.py` taken from that file's source (its imports need triton).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import types
from collections.abc import Iterator
from pathlib import Path

SGLANG_VERSION = "0.5.23"
_KV_EVENTS = "sglang.srt.disaggregation.kv_events"
_UTILS_FUNCTIONS = (
    "get_hash_str",
    "storage_namespace_seed",
    "get_storage_hash_str",
    "hash_str_to_int64",
    "compute_node_hash_values",
    "compute_node_event_hash_values",
)


def sglang_root() -> Path | None:
    """Directory of the installed `sglang` package (found without importing it)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def sglang_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


@contextlib.contextmanager
def _stubbed(modules: dict[str, types.ModuleType]) -> Iterator[None]:
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def _placeholders(*names: str) -> dict[str, types.ModuleType]:
    """Entries for modules a load adds, so `_stubbed` removes them again afterwards."""
    return {name: types.ModuleType(name) for name in names}


def _package(name: str, path: Path) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)]
    return mod


def _exec_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _parents(root: Path) -> dict[str, types.ModuleType]:
    return {
        "sglang": _package("sglang", root),
        "sglang.srt": _package("sglang.srt", root / "srt"),
        "sglang.srt.utils": _package("sglang.srt.utils", root / "srt" / "utils"),
        "sglang.srt.disaggregation": _package(
            "sglang.srt.disaggregation", root / "srt" / "disaggregation"
        ),
        "sglang.srt.mem_cache": _package("sglang.srt.mem_cache", root / "srt" / "mem_cache"),
        "sglang.srt.mem_cache.cpp_utils": _package(
            "sglang.srt.mem_cache.cpp_utils", root / "srt" / "mem_cache" / "cpp_utils"
        ),
    }


def _runtime_context() -> types.ModuleType:
    mod = types.ModuleType("sglang.srt.runtime_context")

    def get_parallel() -> object:
        raise RuntimeError("no SGLang runtime in the contract test")

    mod.get_parallel = get_parallel  # type: ignore[attr-defined]
    return mod


def load_kv_events(root: Path | None = None) -> types.ModuleType:
    """SGLang's own `kv_events` module, executed from its file."""
    root = root or sglang_root()
    assert root is not None, "sglang is not installed"
    stubs = _parents(root) | {"sglang.srt.runtime_context": _runtime_context()}
    with _stubbed(stubs | _placeholders("sglang.srt.utils.network", _KV_EVENTS)):
        _exec_file("sglang.srt.utils.network", root / "srt" / "utils" / "network.py")
        return _exec_file(_KV_EVENTS, root / "srt" / "disaggregation" / "kv_events.py")


_LOAD_SNAPSHOT = "sglang.srt.managers.load_snapshot"


def load_load_snapshot(root: Path | None = None) -> types.ModuleType:
    """SGLang's own `load_snapshot` module (`LoadSnapshot`, what `/v1/loads` serves per rank),
    executed from its file; the runtime and network helpers it names are stand-ins, unused by
    `LoadSnapshot.to_dict`."""
    root = root or sglang_root()
    assert root is not None, "sglang is not installed"
    environ = types.ModuleType("sglang.srt.environ")
    environ.envs = types.SimpleNamespace()  # type: ignore[attr-defined]
    network = types.ModuleType("sglang.srt.utils.network")
    for name in ("is_zmq_endpoint_ipv6", "restrict_zmq_peers", "zmq_connect"):
        setattr(network, name, None)
    runtime = _runtime_context()
    runtime.get_serving = runtime.get_parallel  # type: ignore[attr-defined]
    stubs = _parents(root) | {
        "sglang.srt.managers": _package("sglang.srt.managers", root / "srt" / "managers"),
        "sglang.srt.environ": environ,
        "sglang.srt.runtime_context": runtime,
        "sglang.srt.utils.network": network,
    }
    with _stubbed(stubs | _placeholders(_LOAD_SNAPSHOT)):
        return _exec_file(_LOAD_SNAPSHOT, root / "srt" / "managers" / "load_snapshot.py")


# --- native hash -------------------------------------------------------------------------------


def native_build_missing() -> str | None:
    """Why SGLang's C++ hash cannot be compiled here, or None when it can."""
    if shutil.which("g++") is None:
        return "g++ not found"
    if importlib.util.find_spec("pybind11") is None:
        return "pybind11 not installed (pip install pybind11)"
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").exists():
        return f"Python headers missing in {include}"
    probe = subprocess.run(
        ["g++", "-x", "c++", "-fsyntax-only", "-"],
        input=b"#include <openssl/sha.h>\n",
        capture_output=True,
        check=False,
    )
    if probe.returncode != 0:
        return "OpenSSL headers missing (apt-get install libssl-dev)"
    return None


def _loader_module(build_dir: Path) -> types.ModuleType:
    """Stand-in for `sglang.srt.utils.cpp_extension_loader`: g++ instead of torch's JIT."""
    mod = types.ModuleType("sglang.srt.utils.cpp_extension_loader")

    def load_extension_with_recovery(
        name: str,
        sources: list[str],
        extra_cflags: list[str] | None = None,
        extra_ldflags: list[str] | None = None,
        **_: object,
    ) -> types.ModuleType:
        import pybind11

        digest = hashlib.sha256()
        for src in sources:
            digest.update(Path(src).read_bytes())
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        out_dir = build_dir / digest.hexdigest()[:16]
        target = out_dir / f"{name}{suffix}"
        if not target.exists():
            out_dir.mkdir(parents=True, exist_ok=True)
            tmp = out_dir / f"{name}.tmp{suffix}"
            cmd = [
                "g++",
                "-shared",
                "-fPIC",
                *(extra_cflags or []),
                "-Wno-deprecated-declarations",
                f"-DTORCH_EXTENSION_NAME={name}",
                f"-I{pybind11.get_include()}",
                f"-I{sysconfig.get_paths()['include']}",
                *sources,
                *(extra_ldflags or []),
                "-o",
                str(tmp),
            ]
            subprocess.run(cmd, check=True, capture_output=True)
            tmp.replace(target)
        spec = importlib.util.spec_from_file_location(name, target)
        assert spec is not None and spec.loader is not None
        ext = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ext)
        return ext

    mod.load_extension_with_recovery = load_extension_with_recovery  # type: ignore[attr-defined]
    return mod


def _utils_module(root: Path, get_native_hash: object) -> types.ModuleType:
    """`mem_cache.utils` holding only its hash helpers, compiled from that file's source."""
    path = root / "srt" / "mem_cache" / "utils.py"
    tree = ast.parse(path.read_text())
    body = [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name in _UTILS_FUNCTIONS
    ]
    missing = set(_UTILS_FUNCTIONS) - {node.name for node in body}
    assert not missing, f"{path} no longer defines {sorted(missing)}"
    mod = types.ModuleType("sglang.srt.mem_cache.utils")
    import typing

    mod.__dict__.update(
        hashlib=hashlib,
        get_native_hash=get_native_hash,
        **{n: getattr(typing, n) for n in ("Any", "Callable", "List", "Optional", "Tuple")},
    )
    code = compile(ast.Module(body=body, type_ignores=[]), str(path), "exec")
    exec(code, mod.__dict__)
    return mod


def load_event_recorder(build_dir: Path, root: Path | None = None) -> types.ModuleType:
    """SGLang's `mem_cache/events.py` (KVCacheEventRecorder) over its real native hash."""
    root = root or sglang_root()
    assert root is not None, "sglang is not installed"
    kv_events = load_kv_events(root)
    cpp = root / "srt" / "mem_cache" / "cpp_utils"
    stubs = _parents(root) | {
        "sglang.srt.utils.cpp_extension_loader": _loader_module(build_dir),
        _KV_EVENTS: kv_events,
    }
    native_name = "sglang.srt.mem_cache.cpp_utils.native_hash"
    events_name = "sglang.srt.mem_cache.events"
    with _stubbed(stubs | _placeholders(native_name, events_name)):
        native = _exec_file(native_name, cpp / "native_hash.py")
        native._load_native_hash_module()  # compile now, while the loader stand-in is in place
        utils = _utils_module(root, native.get_native_hash)
        with _stubbed({"sglang.srt.mem_cache.utils": utils}):
            return _exec_file(events_name, root / "srt" / "mem_cache" / "events.py")
