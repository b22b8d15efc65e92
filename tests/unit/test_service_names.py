"""The gRPC service names come from the generated descriptors, in one place
(services/service_names.py), and are the contract's names: health checks and reflection
of every role, and every prober, use these."""
from services import service_names


def test_the_names_are_the_contracts():
    assert service_names.BY_ROLE == {"gateway": "pdserve.v1.Generation",
                                     "prefill": "pdserve.v1.PrefillWorker",
                                     "decode": "pdserve.v1.DecodeWorker"}


def test_servers_and_probers_take_them_from_there():
    from decode_worker.server import ROLE as DECODE
    from gateway import grpc_server, registry
    from prefill_worker.server import ROLE as PREFILL
    assert PREFILL.service_name == service_names.PREFILL
    assert DECODE.service_name == service_names.DECODE
    assert grpc_server.SERVICE == service_names.GENERATION
    pool = registry.WorkerPool("decode", None, 1, 1)
    assert pool._service == service_names.DECODE
