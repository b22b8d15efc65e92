"""What `pdserve profile` prints (a profile's points beside its fits) and the version it stamps."""
from __future__ import annotations

from sim.profile import Profile


def pdserve_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "unknown"


def print_summary(prof: Profile, out) -> None:
    f = prof.fits
    threads = prof.machine.get("threads", {})
    out.write(f"\nprofile {prof.schema}: {prof.model.get('id')} on {prof.machine.get('cpu')}, "
              f"threads prefill={threads.get('prefill')} decode={threads.get('decode')}\n")
    out.write("| prefill chunk | cached | seconds | tok/s | fit |\n| --- | --- | --- | --- | --- |\n")
    for p in prof.prefill:
        n, c, s = p["chunk_tokens"], p["cached_tokens"], p["seconds"]
        out.write(f"| {n:g} | {c:g} | {s:.4f} | {n / max(s, 1e-12):,.0f} | {prof.prefill_s(n, c):.4f} |\n")
    out.write("| decode batch | context (sum) | seconds | tok/s | fit |\n| --- | --- | --- | --- | --- |\n")
    for p in prof.decode:
        b, c, s = p["batch"], p["context_tokens"], p["seconds"]
        out.write(f"| {b:g} | {c:g} | {s:.4f} | {b / max(s, 1e-12):,.0f} | {prof.decode_s(b, c):.4f} |\n")
    out.write("| handover prompt tokens | seconds |\n| --- | --- |\n")
    for p in prof.handover:
        out.write(f"| {p['prompt_tokens']} | {p['seconds']:.5f} |\n")
    out.write(f"gateway per request: {prof.gateway_s * 1000:.2f} ms; KV: {prof.kv.get('num_blocks')} "
              f"blocks of {prof.kv.get('block_size')} tokens per worker\n")
    out.write(f"fits: prefill a,b,c = {_fmt(f['prefill'])}  (a + b*n + c*n*(cached + n/2)); "
              f"decode a,b,c = {_fmt(f['decode'])}  (a + b*batch + c*context); "
              f"handover a,b = {_fmt(f['handover'])}\n")
    if "phase_seconds" in prof.options:
        out.write(f"measured in {prof.options['profile_seconds']} s: {prof.options['phase_seconds']}\n")


def _fmt(coef) -> str:
    return ", ".join(f"{c:.3g}" for c in coef)
