"""gateway/auth.py's key store (parsing, reload, per-key limits), services/security.py's
plain-text port warning and `pdserve up`'s use of it."""
from __future__ import annotations

import os

import pytest

from gateway import auth
from gateway.auth import AuthError, KeyStore, parse_key_file
from pdserve.launcher import Child, Launcher
from pdserve.up import UpConfig, plain_text_ports
from services.security import exposed


def test_parse_key_file():
    keys = parse_key_file("# c\n\nk1\nk2 rpm=5 # note\nk3 concurrency=2 rpm=0\n", 10, 3)
    assert keys == {"k1": (10, 3), "k2": (5, 3), "k3": (0, 2)}
    with pytest.raises(ValueError, match="line 1"):
        parse_key_file("k1 burst=3", 0, 0)


def test_open_without_keys_and_401s():
    assert not KeyStore().enabled
    KeyStore().admit(None).release()
    store = KeyStore(api_key="sk-1")
    for header in (None, "", "Bearer ", "Basic sk-1", "Bearer sk-2"):
        with pytest.raises(AuthError) as e:
            store.admit(header)
        assert e.value.status == 401
    store.admit("Bearer sk-1").release()


def test_key_file_reload_adds_and_revokes(tmp_path):
    f = tmp_path / "keys"
    f.write_text("old\n")
    store = KeyStore(key_file=str(f), reload_interval_s=0)
    store.admit("Bearer old").release()
    f.write_text("new\n")
    os.utime(f, ns=(1, 1))                    # a different mtime even on a coarse clock
    with pytest.raises(AuthError):
        store.admit("Bearer old")
    store.admit("Bearer new").release()
    f.write_text("new rpm=x\n")               # a broken file keeps the keys it had
    os.utime(f, ns=(2, 2))
    store.admit("Bearer new").release()
    with pytest.raises(ValueError):
        KeyStore(key_file=str(tmp_path / "missing"))


def test_rpm_is_a_token_bucket(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: now[0])
    store = KeyStore(api_key="k", rpm=3)
    for _ in range(3):
        store.admit("Bearer k").release()
    with pytest.raises(AuthError) as e:
        store.admit("Bearer k")
    assert e.value.status == 429
    now[0] += 20.0                            # 3 per minute: one more after 20 s
    store.admit("Bearer k").release()
    with pytest.raises(AuthError):
        store.admit("Bearer k")


def test_concurrency_slots_are_released():
    store = KeyStore(api_key="k", concurrency=2)
    a, b = store.admit("Bearer k"), store.admit("Bearer k")
    with pytest.raises(AuthError) as e:
        store.admit("Bearer k")
    assert e.value.status == 429 and "2 requests in flight" in e.value.message
    with a:
        pass
    a.release()                               # twice: still one slot
    store.admit("Bearer k")
    with pytest.raises(AuthError):
        store.admit("Bearer k")
    b.release()


def test_plain_text_ports_beyond_loopback():
    assert exposed("127.0.0.1", {"x": (1, False)}) == []
    assert exposed("0.0.0.0", {"a": (1, False), "b": (2, True), "off": (0, False)}) == ["a 0.0.0.0:1"]
    launcher = Launcher("m", host="0.0.0.0", http_port=8000, children=[
        Child("prefill", "0.0.0.0:7001", ["prefill", "--worker-id", "prefill-0",
                                           "--metrics-port", "7101", "--metrics-port", "7102"]),
        Child("decode", "0.0.0.0:7002", ["decode", "--worker-id", "decode-0", "--metrics-port",
                                         "7103", "--health-port", "7104"]),
        Child("gateway", "0.0.0.0:7000", ["gateway"])])
    lines = plain_text_ports(UpConfig(host="0.0.0.0"), launcher)
    assert lines[:-1] == [f"{p} listens in plain text beyond loopback" for p in (
        "gateway gRPC 0.0.0.0:7000", "gateway REST 0.0.0.0:8000",
        "prefill worker gRPC (prefill-0) 0.0.0.0:7001",
        "prefill worker /metrics (prefill-0) 0.0.0.0:7102",       # the last --metrics-port wins
        "decode worker gRPC (decode-0) 0.0.0.0:7002", "decode worker /metrics (decode-0) 0.0.0.0:7103",
        "decode worker health (decode-0) 0.0.0.0:7104")]
    assert "KV (UCX)" in lines[-1]
    # mTLS and TLS cover the gRPC and REST ports; the workers' HTTP ports stay plain
    tls = plain_text_ports(UpConfig(host="0.0.0.0", tls_cert="c", tls_key="k", mtls_ca="a",
                                    mtls_cert="c", mtls_key="k"), launcher)
    assert [s.split(" listens")[0] for s in tls[:-1]] == [
        "prefill worker /metrics (prefill-0) 0.0.0.0:7102", "decode worker /metrics (decode-0) 0.0.0.0:7103",
        "decode worker health (decode-0) 0.0.0.0:7104"]
    assert plain_text_ports(UpConfig(host="127.0.0.1"), launcher) == []
