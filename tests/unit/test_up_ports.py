"""`pdserve up` checks its fixed ports once, in Launcher.start, before the default model is
fetched or anything started: a busy port is one line and exit 1, and no fetch happens."""
from __future__ import annotations

import socket

import pytest

from pdserve import default_model, up
from pdserve.launcher import Launcher
from pdserve.processes import LaunchError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def no_fetch(monkeypatch):
    fetched = []
    monkeypatch.setattr(default_model, "resolve_default_model", lambda *a, **k: fetched.append(1))
    return fetched


def test_a_busy_port_fails_before_the_default_model_is_fetched(busy_port, no_fetch, capsys):
    cfg = up.UpConfig(grpc_port=busy_port, http_port=0)
    assert up.main(cfg) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [f"pdserve up: the gateway's gRPC (--grpc-port) port {busy_port} "
                                "on 127.0.0.1 already in use (another pdserve?); nothing was started"]
    assert no_fetch == []


def test_the_launcher_checks_its_fixed_ports_itself(busy_port, no_fetch):
    launcher = Launcher(http_port=busy_port)
    with pytest.raises(LaunchError, match=f"REST .--http-port. port {busy_port} .* already in use"):
        launcher.start(10)
    assert no_fetch == [] and launcher.children == []
