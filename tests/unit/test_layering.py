"""The layer table of DESIGN.md and the package READMEs, checked on every import in the source
(lazy ones inside functions included): dependencies point downward only, and no two files
import each other, directly or round a longer loop."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protos", "engine", "kvtransfer", "services", "prefill_worker", "decode_worker",
            "gateway", "sim", "pdserve")
# package -> the project packages it may import (itself always)
MAY_IMPORT = {
    "protos": set(),
    "engine": set(),
    "kvtransfer": {"engine"},
    "services": {"engine", "kvtransfer", "protos"},
    "prefill_worker": {"engine", "kvtransfer", "protos", "services"},
    "decode_worker": {"engine", "kvtransfer", "protos", "services"},
    "gateway": {"engine", "protos", "services"},
    "sim": {"engine", "gateway", "prefill_worker", "services", "protos"},
    "pdserve": set(PACKAGES),
}
# the engine modules the gateway may use: none of them imports torch
GATEWAY_ENGINE = {"engine.tokenizer", "engine.gguf", "engine.sampling_params", "engine.structured",
                  "engine.output_processor", "engine.block_hash", "engine.kv_events"}
# inside the engine, downward only: kernels < quantization schemes < model families; none of
# them knows the step machinery (scheduler, runner, loader, engine) above them
ENGINE_LAYERS = {
    "engine.kernels": {"engine.kernels", "engine.config"},
    "engine.quant": {"engine.kernels", "engine.quant"},
    "engine.models": {"engine.kernels", "engine.quant", "engine.models", "engine.config"},
}
# torch-free, so the CLI, the config and the gateway can import them: the registries too
TORCH_FREE = GATEWAY_ENGINE | {"engine.config", "engine.rope_config", "engine.models", "engine.quant",
                               "engine.spec_decode", "engine.gguf_arch", "engine.gguf_moe"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every project module `path` imports, as dotted names (`from pkg import mod` counts as
    pkg.mod when that is a module)."""
    me = _module_name(path)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if _exists(f"{base}.{a.name}"))
    return {m for m in found if m.split(".")[0] in PACKAGES and _exists(m)}


def _exists(dotted: str) -> bool:
    p = ROOT.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _graph() -> dict[str, set[str]]:
    files = [f for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py")
             if not f.name.endswith(("_pb2.py", "_pb2_grpc.py"))]
    return {_module_name(f): _imports(f) for f in files}


def test_every_import_follows_the_layer_table():
    bad = []
    for mod, deps in _graph().items():
        pkg = mod.split(".")[0]
        for dep in deps:
            other = dep.split(".")[0]
            if other != pkg and other not in MAY_IMPORT[pkg]:
                bad.append(f"{mod} imports {dep}")
            if pkg == "gateway" and other == "engine" and dep not in GATEWAY_ENGINE | {"engine"}:
                bad.append(f"{mod} imports {dep} (the gateway may use only {sorted(GATEWAY_ENGINE)})")
    assert not bad, "\n".join(sorted(bad))


def test_no_file_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}        # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if d == m or d == m.rpartition(".")[0]:
                continue          # a module and its own package's __init__
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_engine_layers_point_downward():
    bad = []
    for mod, deps in _graph().items():
        layer = next((l for l in ENGINE_LAYERS if mod == l or mod.startswith(l + ".")), None)
        if layer is None:
            continue
        allowed = ENGINE_LAYERS[layer]
        for dep in deps:
            if dep.startswith("engine.") and not any(dep == a or dep.startswith(a + ".") for a in allowed):
                bad.append(f"{mod} imports {dep}")
    assert not bad, "\n".join(sorted(bad))


def test_the_registries_and_configs_never_import_torch():
    code = (f"import sys, importlib; [importlib.import_module(m) for m in {sorted(TORCH_FREE)!r}]; "
            "from engine.models import SUPPORTED_ARCHITECTURES; from engine.quant import QUANTIZATIONS; "
            "assert SUPPORTED_ARCHITECTURES and QUANTIZATIONS; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')); "
            "assert not bad, bad[:5]")
    _python_passes(code)


def _python_passes(code: str) -> None:
    """`code` run in a fresh interpreter (nothing imported yet) exits 0."""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_gateway_process_never_imports_torch():
    code = ("import sys, gateway.grpc_server, gateway.openai, gateway.core; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'triton', 'kvtransfer', 'prefill_worker', 'decode_worker')); "
            "assert not bad, bad[:5]")
    _python_passes(code)


def test_the_table_is_not_vacuous():
    """The checks above see real imports: the roles import the services, the gateway the
    tokenizer, the workers the engine."""
    graph = _graph()
    assert "services.worker_server" in graph["prefill_worker.server"] | graph["decode_worker.server"] \
        or any(d.startswith("services.") for d in graph["prefill_worker.server"])
    assert any(d == "engine.tokenizer" for m, ds in graph.items() if m.startswith("gateway") for d in ds)
    assert any(d.startswith("engine.") for d in graph["decode_worker.server"])
    assert "engine.quant.linear" in graph["engine.models.base"] and "engine.kernels" in graph["engine.quant.int8"]


def test_every_package_ships():
    """Each package of the table is a regular package that the wheel and the image carry:
    a namespace package (no __init__.py) works from a checkout but is left out of both."""
    import tomllib
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]["include"]
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    for pkg in PACKAGES:
        assert (ROOT / pkg / "__init__.py").is_file(), f"{pkg}/ has no __init__.py"
        assert f"{pkg}*" in include, f"pyproject.toml's packages do not include {pkg}"
        assert f"COPY {pkg} ./{pkg}" in dockerfile, f"deploy/Dockerfile does not copy {pkg}/"
