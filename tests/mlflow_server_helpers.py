"""A real `mlflow server` for tests: started on a free port in its own process group, waited for through
/health, stopped with its group (shared by test_train_mlflow_server.py and test_mlflow_ui_server.py)."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_json(url, payload):
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read().decode())


class MlflowServer:
    """`mlflow server --backend-store-uri <uri> [extra args]`, its output in <workdir>/server.log. Starting does
    not wait: call wait() before the first request (other work can overlap the server's start)."""

    def __init__(self, workdir, backend_uri: str, *extra_args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(str(workdir), "server.log")
        mlflow_bin = shutil.which("mlflow", path=os.path.dirname(sys.executable)) or "mlflow"
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        env.pop("MLFLOW_TRACKING_URI", None)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [mlflow_bin, "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", backend_uri, *extra_args],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).read()
                return self.url
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self._log.flush()
                    with open(self.log_path) as f:
                        pytest.fail("mlflow server did not start:\n" + f.read()[-3000:])
                time.sleep(0.3)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=15)
        except Exception:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()
