"""Runs `pdserve` with cluster DNS answered from a file: the gateway's resolver seam.

    python tests/e2e/cluster_dns_shim.py HOSTS_JSON pdserve-args...

HOSTS_JSON maps a DNS name to its A records ({"pdserve-decode.ns.svc.cluster.local":
["127.0.9.4"]}), rewritten by the test as a cluster's endpoints controller would (ready pods
only). The gateway's DnsResolver reads it at every refresh instead of calling getaddrinfo;
everything else is the `pdserve` command unchanged.
"""
import json
import socket
import sys

from gateway import discovery


def main() -> int:
    hosts_file, argv = sys.argv[1], sys.argv[2:]

    def resolve(host: str, port: int) -> list[str]:
        with open(hosts_file) as f:
            records = json.load(f)
        if host not in records:
            raise socket.gaierror(socket.EAI_NONAME, f"{host}: no such name")
        return records[host]

    discovery._getaddrinfo_ips = resolve
    from pdserve.cli import main as pdserve_main
    return pdserve_main(argv)


if __name__ == "__main__":
    sys.exit(main())
