"""Runs `pdserve` with cluster DNS answered from a file, as a pod's resolver would.

    python tests/e2e/cluster_dns_shim.py HOSTS_JSON pdserve-args...

HOSTS_JSON maps a DNS name to its A records ({"pdserve-decode.ns.svc.cluster.local":
["127.9.9.4"]}), rewritten by the test as a cluster's endpoints controller would (ready pods
only). The gateway's DnsResolver (its resolver seam, gateway/discovery.py) and every
socket.getaddrinfo call (the prefill worker's --decode-dns) read it for the names it holds;
other names resolve as usual. Everything else is the `pdserve` command unchanged.
"""
import json
import socket
import sys

from gateway import discovery


def main() -> int:
    hosts_file, argv = sys.argv[1], sys.argv[2:]

    def records() -> dict[str, list[str]]:
        with open(hosts_file) as f:
            return json.load(f)

    def resolve(host: str, port: int) -> list[str]:
        ips = records().get(host)
        if ips is None:
            raise socket.gaierror(socket.EAI_NONAME, f"{host}: no such name")
        return ips

    system_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        ips = records().get(host)
        if ips is None:
            return system_getaddrinfo(host, port, family, type, proto, flags)
        return [(socket.AF_INET, type or socket.SOCK_STREAM, proto, "", (ip, int(port)))
                for ip in ips]

    discovery._getaddrinfo_ips = resolve
    socket.getaddrinfo = getaddrinfo
    from pdserve.cli import main as pdserve_main
    return pdserve_main(argv)


if __name__ == "__main__":
    sys.exit(main())
