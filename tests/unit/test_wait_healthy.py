"""launch/serve_process.wait_healthy against real HTTP servers on 127.0.0.1 (a child process each): ready on a 200
with no body (ours) or with {"status": "ok"} (llama.cpp's llama-server); not on ours while data-parallel replicas
are still starting (200 with {"status": "degraded"}) nor on a 503; and it says so when the process exits."""
import subprocess
import sys
import textwrap

import pytest

from nanovllm_tp.launch.serve_process import free_port, stop, wait_healthy

SERVER = textwrap.dedent("""
    import http.server, sys
    status, body = int(sys.argv[2]), sys.argv[3].encode()
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
""")


def health_server(status: int, body: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(status), body])
    return proc, f"http://127.0.0.1:{port}/health"


@pytest.mark.parametrize("body", ["", '{"status":"ok"}'])
def test_ready_on_an_empty_200_or_status_ok(body):
    proc, url = health_server(200, body)
    try:
        wait_healthy(proc, url, "the peer", timeout=30)
    finally:
        stop(proc, timeout=5)


@pytest.mark.parametrize("status, body", [(200, '{"status":"degraded","replicas_alive":1}'), (503, ""),
                                          (200, "not json")])
def test_not_ready_while_degraded_or_loading(status, body):
    proc, url = health_server(status, body)
    try:
        with pytest.raises(SystemExit, match="not ready within 2 s"):
            wait_healthy(proc, url, "the peer", timeout=2)
    finally:
        stop(proc, timeout=5)


def test_a_process_that_exits_first_is_reported():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(SystemExit, match="exited with 3"):
        wait_healthy(proc, f"http://127.0.0.1:{free_port()}/health", "the peer", timeout=30)
