"""Talks the PMI-1 wire protocol to slurmstepd directly (as MPICH does) and puts one value of N characters:
shows how long a request slurmstepd's mpi/pmi2 plugin reads whole."""

import os
import socket
import sys

server = socket.socket(fileno=int(os.environ["PMI_FD"]))
replies = server.makefile("rb")


def request(line: str) -> str:
    server.sendall(line.encode())
    return replies.readline().decode().strip()


assert request("cmd=init pmi_version=1 pmi_subversion=1\n").startswith("cmd=response_to_init rc=0")
kvsname = request("cmd=get_my_kvsname\n").split("kvsname=")[1]
line = f"cmd=put kvsname={kvsname} key=-allgather-1-0-seg-1/9 value={'3' * int(sys.argv[1])}\n"
server.sendall(line.encode())
server.settimeout(5)
print(f"request of {len(line)} bytes: {replies.readline().decode().strip()}", flush=True)
