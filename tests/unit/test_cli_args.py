"""services.cli_args: config dataclasses (nested ones flattened) <-> command-line options, and
the configs built on it (workers, `pdserve up`) keep one default per engine option."""
from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from decode_worker.config import DecodeWorkerConfig
from engine.config import CacheConfig, EngineOptions, SchedulerConfig
from pdserve.cli import build_parser
from pdserve.launcher import Launcher
from pdserve.up import UpConfig
from prefill_worker.config import PrefillWorkerConfig
from services.cli_args import config_argv, config_from_args, dataclass_args


@dataclass
class Leaf:
    leaf_size: int = 4
    fast: bool = True


@dataclass
class Middle:
    ratio: float = 0.5
    limit: int | None = None
    leaf: Leaf = field(default_factory=Leaf)


@dataclass
class Root:
    path: str = field(metadata={"aliases": ["--where"]})
    name: str = "x"
    middle: Middle = field(default_factory=Middle)
    hidden: int = field(default=7, metadata={"cli": False})


@dataclass
class Clash:
    ratio: int = 1                     # Middle has a `ratio` too
    middle: Middle = field(default_factory=Middle)


def _parser(cls) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    dataclass_args(p, cls)
    return p


def _parse(cls, argv):
    return config_from_args(cls, _parser(cls).parse_args(argv))


def test_nested_fields_flatten():
    flags = {s for a in _parser(Root)._actions for s in a.option_strings}
    assert {"--path", "--where", "--name", "--ratio", "--limit", "--leaf-size", "--fast",
            "--no-fast"} <= flags
    assert not {f for f in flags if "middle" in f or "--leaf-leaf" in f or "hidden" in f}
    cfg = _parse(Root, ["--path", "p", "--ratio", "2.5", "--leaf-size", "9", "--limit", "3"])
    assert cfg == Root("p", middle=Middle(2.5, 3, Leaf(leaf_size=9)))
    assert isinstance(cfg.middle.leaf, Leaf) and cfg.hidden == 7


def test_defaults_come_from_the_nested_dataclass():
    assert _parse(Root, ["--path", "p"]) == Root("p")
    cfg = _parse(PrefillWorkerConfig, ["--model-dir", "m"])
    assert cfg.engine == EngineOptions() and cfg.engine.cache == CacheConfig()
    assert cfg.engine.cache.kv_cache_memory_gb == CacheConfig().kv_cache_memory_gb == 0.5
    assert cfg.engine.scheduler == SchedulerConfig()
    assert EngineOptions.of() == EngineOptions()        # LLMEngine.from_model_dir's defaults
    assert UpConfig().engine == EngineOptions()


def test_bool_flags():
    assert _parse(Root, ["--path", "p", "--no-fast"]).middle.leaf.fast is False
    assert _parse(Root, ["--path", "p", "--fast"]).middle.leaf.fast is True
    cfg = _parse(DecodeWorkerConfig, ["--model", "m", "--no-enable-prefix-caching"])
    assert cfg.engine.cache.enable_prefix_caching is False


def test_required_field_and_alias(capsys):
    with pytest.raises(SystemExit):
        _parser(Root).parse_args([])
    assert "required: --path/--where" in capsys.readouterr().err
    assert _parse(Root, ["--where", "w"]).path == "w"
    assert _parse(PrefillWorkerConfig, ["--model", "m"]).model_dir == "m"


def test_a_name_clash_fails_when_the_parser_is_built():
    with pytest.raises(argparse.ArgumentError, match="--ratio"):
        _parser(Clash)


def test_bad_values_fail_where_the_config_is_built():
    for argv, msg in ((["--block-size", "3"], "power of two"),
                      (["--max-num-seqs", "0"], "max_num_seqs"),
                      (["--kernel-backend", "cuda"], "unknown kernel backend"),
                      (["--dtype", "int8"], "unsupported dtype"),
                      (["--num-blocks", "0"], "num_blocks")):
        with pytest.raises(ValueError, match=msg):
            _parse(PrefillWorkerConfig, ["--model", "m", *argv])


def test_round_trip():
    cfg = Root("p", "y", Middle(1.5, 12, Leaf(8, fast=False)))
    argv = config_argv(cfg)
    assert argv == ["--path", "p", "--name", "y", "--ratio", "1.5", "--limit", "12",
                    "--leaf-size", "8", "--no-fast"]
    assert _parse(Root, argv) == cfg
    assert config_argv(Root("p")) == ["--path", "p"]            # defaults are left out
    worker = PrefillWorkerConfig("m", engine=EngineOptions(
        device="cuda", dtype="bfloat16", max_model_len=256,
        cache=CacheConfig(block_size=32, num_blocks=64, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=4)), port=1234)
    assert _parse(PrefillWorkerConfig, config_argv(worker)) == worker


def test_engine_options_by_name():
    o = EngineOptions.of(block_size=8, max_num_seqs=4, device="cuda", max_model_len=64)
    assert o == EngineOptions(device="cuda", max_model_len=64, cache=CacheConfig(block_size=8),
                              scheduler=SchedulerConfig(max_num_seqs=4))
    with pytest.raises(TypeError, match="blok_size"):
        EngineOptions.of(blok_size=8)


def test_pdserve_up_passes_engine_options_to_every_worker(monkeypatch):
    args = build_parser().parse_args(["up", "--prefill", "2", "--device", "cuda",
                                      "--block-size", "32", "--no-enable-prefix-caching",
                                      "--max-model-len", "128"])
    up = config_from_args(UpConfig, args)
    assert (up.prefill, up.decode, up.grpc_port, up.http_port) == (2, 1, 50051, 8000)
    assert up.engine == EngineOptions(device="cuda", max_model_len=128, cache=CacheConfig(
        block_size=32, enable_prefix_caching=False))
    launcher = Launcher("m", up.prefill, up.decode, engine=up.engine,
                        decode_args=["--block-size", "8"])
    monkeypatch.setattr(Launcher, "_spawn", lambda self, c: self.children.append(c))
    monkeypatch.setattr(Launcher, "_wait_serving", lambda self, c, deadline: None)
    launcher.start()
    workers = {"prefill": PrefillWorkerConfig, "decode": DecodeWorkerConfig}
    got = [(c.role, config_from_args(workers[c.role], build_parser().parse_args(c.argv)).engine)
           for c in launcher.children if c.role != "gateway"]
    assert got == [("prefill", up.engine), ("prefill", up.engine),       # a role's own args win
                   ("decode", EngineOptions(device="cuda", max_model_len=128, cache=CacheConfig(
                       block_size=8, enable_prefix_caching=False)))]
    gateway = launcher.children[-1].argv
    assert "--max-model-len" not in gateway     # the gateway learns it from the workers' Stats
    assert Launcher("m").engine == EngineOptions()      # and by default the workers get nothing
    with pytest.raises(ValueError, match="--prefill must be >= 0 and --decode >= 1"):
        UpConfig(decode=0)
    with pytest.raises(ValueError, match="--prefill 0 --disaggregation always"):
        UpConfig(prefill=0, disaggregation="always")
    with pytest.raises(ValueError, match="--disaggregation must be one of"):
        UpConfig(disaggregation="sometimes")


def test_up_with_no_prefill_workers_gives_the_decode_workers_every_core():
    """`pdserve up --prefill 0`: legal with never/auto; the gateway gets the mode and an
    empty prefill list; the decode workers share all the cores (nobody else computes)."""
    up = UpConfig(prefill=0, decode=2, disaggregation="never")
    assert up.threads(cores=8) == (8, 4)
    assert UpConfig(prefill=1, decode=2).threads(cores=8) == (8, 2)
    from pdserve.up import gateway_argv
    argv = gateway_argv(up)
    assert argv[argv.index("--disaggregation") + 1] == "never"
    launcher = Launcher("m", 0, 1)
    launcher.children = []
    assert launcher._gateway_models()[:4] == ["--model", "m", "--prefill", ""]


def test_the_cli_does_not_import_torch():
    """The gateway runs through pdserve.cli and never loads torch; the configs it imports
    (the workers' and the engine's) must not either."""
    code = "import sys, pdserve.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("argv", [
    ["up", "--prefil", "2"],                              # `up`'s own option
    ["up", "--block-siz", "32"],                          # an engine option, flattened
    ["gateway", "--grpc-por", "0"],
    ["prefill", "--model", "m", "--drain-timeout", "5"],
    ["eval", "perplexity", "--model", "m", "--data", "x", "--contex", "8"],
])
def test_abbreviated_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert "unrecognized arguments" in capsys.readouterr().err


def test_a_worker_module_refuses_abbreviations_too():
    from services.cli_args import config_from_argv
    with pytest.raises(SystemExit):
        config_from_argv(PrefillWorkerConfig, ["--model", "m", "--drain-timeout", "5"], "x")


@pytest.mark.parametrize("argv", [
    ["up", "--http-port", "-1"], ["gateway", "--http-port", "-1"],
    ["gateway", "--metrics-port", "-1"], ["up", "--grpc-port", "-1"],
])
def test_minus_one_is_not_off_and_says_what_is(argv):
    args = build_parser().parse_args(argv)
    cls = UpConfig if argv[0] == "up" else __import__("gateway.config").config.GatewayConfig
    with pytest.raises(ValueError, match=r"--\w+-port -1: give 0 for off"):
        config_from_args(cls, args)


def test_zero_is_off_for_up_and_gateway_alike():
    up = config_from_args(UpConfig, build_parser().parse_args(["up", "--http-port", "0"]))
    assert up.http_port == 0
    launcher = Launcher("m", http_port=up.http_port)
    assert launcher.http_port == 0     # what the gateway gets: its own 0, off
    with pytest.raises(ValueError, match="0-65535"):
        config_from_args(UpConfig, build_parser().parse_args(["up", "--http-port", "70000"]))


def test_up_sets_the_disaggregation_bounds_by_device():
    """On cpu every worker shares this host's cores: short prompts stay on their decode
    worker and no stall bound applies; elsewhere the gateway's defaults (not passed); given
    values win either way, and below -1 is refused."""
    from engine.config import EngineOptions
    from pdserve.up import CPU_DISAGG, disagg_args
    assert disagg_args(UpConfig()) == {"--disagg-max-local-tokens": str(CPU_DISAGG[0]),
                                       "--disagg-max-stall-ms": "0"}
    assert disagg_args(UpConfig(engine=EngineOptions(device="cuda"))) == {}
    assert disagg_args(UpConfig(disagg_max_local_tokens=64, disagg_max_stall_ms=50)) == {}
    assert disagg_args(UpConfig(engine=EngineOptions(device="cuda"), disagg_max_local_tokens=1000,
                                disagg_max_stall_ms=12.5)) == {
        "--disagg-max-local-tokens": "1000", "--disagg-max-stall-ms": "12.5"}
    with pytest.raises(ValueError, match="-1: by device"):
        UpConfig(disagg_max_stall_ms=-2)
