"""The full names of pdserve's gRPC services, read once from the generated descriptors
(protos/pdserve/v1/*_pb2.py), so no other file spells them: the servers register and report
health under them, the gateway's and the launcher's health probes ask for them."""
from __future__ import annotations

from protos.pdserve.v1 import decode_pb2, generation_pb2, prefill_pb2

GENERATION = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
PREFILL = prefill_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
DECODE = decode_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
# what a process of each role serves ("gateway" | "prefill" | "decode")
BY_ROLE = {"gateway": GENERATION, "prefill": PREFILL, "decode": DECODE}
