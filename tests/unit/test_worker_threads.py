"""Threads per worker role: `--threads` (0: every core the process may run on, or the
environment's OMP_NUM_THREADS), and `pdserve up`'s shares (--prefill-threads,
--decode-threads), with the reservation flags it hands the decode workers."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from decode_worker.config import DecodeWorkerConfig
from pdserve.cli import build_parser
from pdserve.launcher import Launcher
from pdserve.up import UpConfig, worker_args
from pdserve.processes import ModelPools
from prefill_worker.config import PrefillWorkerConfig
from services.cli_args import config_from_args

ROOT = Path(__file__).resolve().parents[2]


def _threads_in_a_process(cores: set[int], num_threads: int, omp: str | None) -> tuple[int, int]:
    """(what limit_threads returned, torch.get_num_threads()) in a fresh process pinned to
    `cores`."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    code = (f"import os; os.sched_setaffinity(0, {sorted(cores)!r}); import torch; "
            f"from services.worker_server import limit_threads; "
            f"n = limit_threads({num_threads}); print(n, torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    a, b = out.stdout.split()
    return int(a), int(b)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity")
def test_zero_threads_means_every_core_the_process_may_use():
    cores = sorted(os.sched_getaffinity(0))
    assert _threads_in_a_process({cores[0]}, 0, None) == (1, 1)
    assert _threads_in_a_process(set(cores), 0, None) == (len(cores), len(cores))
    assert _threads_in_a_process(set(cores), 0, "1") == (1, 1)        # the environment's
    assert _threads_in_a_process({cores[0]}, 3, None) == (3, 3)       # as given


def test_threads_flag_on_both_workers():
    for role, cls in (("prefill", PrefillWorkerConfig), ("decode", DecodeWorkerConfig)):
        cfg = config_from_args(cls, build_parser().parse_args([role, "--model", "m", "--threads", "2"]))
        assert cfg.num_threads == 2
        assert config_from_args(cls, build_parser().parse_args([role, "--model", "m"])).num_threads == 0
    with pytest.raises(ValueError):
        PrefillWorkerConfig(model_dir="m", num_threads=-1)


def test_up_splits_the_cores_between_the_roles():
    up = UpConfig()
    assert up.threads(cores=2) == (2, 1)               # 1 prefill + 1 decode on 2 cores
    assert up.threads(cores=16) == (16, 8)
    assert UpConfig(prefill=2, decode=2).threads(cores=16) == (8, 4)
    assert UpConfig(prefill=4).threads(cores=2) == (1, 1)
    assert UpConfig(prefill_threads=3, decode_threads=2).threads(cores=16) == (3, 2)
    two = [ModelPools("a", "x", 1, 1), ModelPools("b", "y", 1, 1)]
    assert up.threads(two, cores=8) == (4, 2)
    with pytest.raises(ValueError):
        UpConfig(kv_expiry_s=700)                        # past the default bound of 600 s


def test_up_hands_threads_and_reservation_flags_to_the_workers(monkeypatch):
    up = config_from_args(UpConfig, build_parser().parse_args([
        "up", "--prefill-threads", "3", "--decode-threads", "2", "--kv-expiry-s", "20",
        "--kv-max-reservation-s", "900", "--max-queue-delay-factor", "6", "--num-blocks",
        "400", "--prefill-num-blocks", "100"]))
    prefill_args, decode_args = worker_args(up)
    lau = Launcher("m", prefill_args=prefill_args, decode_args=decode_args, engine=up.engine)
    monkeypatch.setattr(Launcher, "_spawn", lambda self, c: self.children.append(c))
    monkeypatch.setattr(Launcher, "_wait_serving", lambda self, c, deadline: None)
    lau.start()
    workers = {"prefill": PrefillWorkerConfig, "decode": DecodeWorkerConfig}
    cfgs = {c.role: config_from_args(workers[c.role], build_parser().parse_args(c.argv))
            for c in lau.children if c.role != "gateway"}
    assert (cfgs["prefill"].num_threads, cfgs["prefill"].max_queue_delay_factor) == (3, 6.0)
    d = cfgs["decode"]
    assert (d.num_threads, d.kv_expiry_s, d.kv_max_reservation_s) == (2, 20.0, 900.0)
    # the prefill pools their own size, the decode workers --num-blocks
    assert (cfgs["prefill"].engine.cache.num_blocks, d.engine.cache.num_blocks) == (100, 400)
    with pytest.raises(ValueError):
        UpConfig(prefill_num_blocks=-1)


def test_a_cgroup_cpu_limit_caps_the_cores(tmp_path):
    from services.worker_config import available_cores
    f = tmp_path / "cpu.max"
    all_cores = available_cores(str(tmp_path / "none"))
    f.write_text("max 100000\n")
    assert available_cores(str(f)) == all_cores
    f.write_text("150000 100000\n")                    # a limit of 1.5 CPUs: 2 threads
    assert available_cores(str(f)) == min(all_cores, 2)
    f.write_text("50000 100000\n")
    assert available_cores(str(f)) == 1
