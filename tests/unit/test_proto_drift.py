"""The committed gRPC stubs must equal what protos/generate.py produces from the .proto files."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUB_DIR = ROOT / "protos" / "pdserve" / "v1"


def _load_generate():
    spec = importlib.util.spec_from_file_location("_protos_generate", ROOT / "protos" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stubs_match_protos(tmp_path):
    fresh = _load_generate().generate(tmp_path)
    committed = sorted(p.relative_to(ROOT) for p in STUB_DIR.glob("*_pb2*.py*"))
    assert [str(p) for p in fresh] == [str(p) for p in committed], \
        "stub files differ from the .proto files: run `python protos/generate.py` and commit"
    for rel in fresh:
        assert (tmp_path / rel).read_bytes() == (ROOT / rel).read_bytes(), \
            f"{rel} is stale: run `python protos/generate.py` and commit the result"


def test_stubs_import_as_protos_package():
    from protos.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, generation_pb2_grpc, prefill_pb2_grpc
    assert decode_pb2.DESCRIPTOR.package == "pdserve.v1"
    assert hasattr(decode_pb2_grpc, "DecodeWorkerStub")
    assert hasattr(prefill_pb2_grpc, "PrefillWorkerServicer")
    assert hasattr(generation_pb2_grpc, "add_GenerationServicer_to_server")
    sp = common_pb2.SamplingParams(temperature=0.0)
    assert sp.HasField("temperature") and not sp.HasField("top_p")
    assert "pdserve" not in sys.modules or hasattr(sys.modules["pdserve"], "__path__")


def test_sampling_params_cover_engine_fields():
    """Every engine SamplingParams field has a proto field of the same name."""
    import dataclasses
    from engine.sampling_params import SamplingParams
    from protos.pdserve.v1 import common_pb2
    proto_fields = set(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
    missing = {f.name for f in dataclasses.fields(SamplingParams)} - proto_fields
    assert not missing, f"engine SamplingParams fields missing from the proto: {sorted(missing)}"
