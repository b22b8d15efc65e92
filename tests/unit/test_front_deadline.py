"""The gateway's end-to-end deadline follows the tokens asked for (Gateway.request_timeout):
request_timeout_s + (prompt + max_tokens) x request_timeout_per_token_s, at most
max_request_timeout_s; an unset max_tokens counts as the context's room. Behaviour on the
P/D path: test_pd_deadlines.py."""
import pytest

from engine.tiny_model import ensure_default_model
from gateway.config import GatewayConfig
from gateway.core import Gateway


@pytest.fixture(scope="module")
def model_dir():
    return str(ensure_default_model())


def _gw(model_dir, **kw):
    return Gateway(GatewayConfig(model=model_dir, prefill="127.0.0.1:1", decode="127.0.0.1:2", **kw))


def test_the_deadline_grows_with_the_tokens(model_dir):
    gw = _gw(model_dir)                     # 120 s + 0.1 s a token, at most 3600 s
    assert gw.request_timeout(10, 16) == pytest.approx(120 + 2.6)
    assert gw.request_timeout(3000, 2400) == pytest.approx(120 + 540)
    assert gw.request_timeout(100, 2400) > 120 + 240     # past the old fixed 120 s
    assert gw.request_timeout(8000, 100000) == 3600


def test_unset_max_tokens_counts_the_contexts_room(model_dir):
    gw = _gw(model_dir, max_model_len=1000)
    assert gw.max_model_len == 1000
    assert gw.request_timeout(200, None) == pytest.approx(120 + (200 + 800) * 0.1)
    assert gw.request_timeout(1000, None) == pytest.approx(120 + 1001 * 0.1)


def test_the_limits_are_flags(model_dir):
    gw = _gw(model_dir, request_timeout_s=5, request_timeout_per_token_s=0.5, max_request_timeout_s=60)
    assert gw.request_timeout(10, 0) == pytest.approx(10)
    assert gw.request_timeout(10, 500) == 60
    assert _gw(model_dir, request_timeout_per_token_s=0).request_timeout(5000, 3000) == 120
    with pytest.raises(ValueError):
        GatewayConfig(model=model_dir, request_timeout_s=10, max_request_timeout_s=5)
