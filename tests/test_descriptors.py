"""Running out of descriptors anyway: asyncio logs a traceback for every accept() that fails
with EMFILE, up to its backlog per loop turn (242,359 in 3 s in issue 31's HTTPS flood); the
daemon's handler leaves one summary line per interval. A real asyncio server in a subprocess
with a descriptor limit of 32, and real connections from this process."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from tests.support.models import ROOT

SERVER = """
import asyncio, logging, resource
from edge_batcher.transports.descriptors import summarise_accept_errors
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))

async def main():
    loop = asyncio.get_running_loop()
    summarise_accept_errors(loop)
    server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)  # keeps every connection open
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.sleep(3)
    loop.call_exception_handler({"message": "something else"})  # other errors are logged as before

asyncio.run(main())
"""


def test_accept_failing_for_want_of_descriptors_is_one_line_per_interval():
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    port = int(proc.stdout.readline())
    held = []
    try:
        for _ in range(100):  # more than the server's 32 descriptors
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(1.5)
        _, log = proc.communicate(timeout=30)
    finally:
        for s in held:
            s.close()
        proc.kill()
    lines = log.splitlines()
    summaries = [line for line in lines if "accept() failed" in line]
    assert len(summaries) == 1 and summaries[0].startswith("WARNING"), log[-3000:]
    assert "Too many open files" in summaries[0] and "LimitNOFILE" in summaries[0]
    assert "Traceback" not in log and "out of system resource" not in log, log[-3000:]
    assert any("something else" in line for line in lines), log[-3000:]
    assert len(lines) < 10, log[-3000:]
