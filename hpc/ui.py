"""``python -m hpc ui [RUNS_DIR | RUN_DIR]``: the MLflow UI over the runs' embedded store, one command away.

MLflow's server listens on a Unix socket in a private (0700) folder, so that no other user of the login node can
reach it; in front of it a small proxy on 127.0.0.1:PORT lets in only requests that carry a per-session token (the
printed URL's ``?token=``, then a cookie), as Jupyter does: a loopback port is open to every user of the host, and
MLflow's UI can change and delete runs. A run tracked by a server (tracking.uri http...) is shown where it is: the
command prints that server's URL. Needs the full ``mlflow`` package (``pip install -e .[ui]``); torch-free.
"""

from __future__ import annotations

import http.client
import http.server
import importlib.util
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

from hpc.status import VerbError
from rundir.paths import RunDir
from tracking.target import STORE_NAME, default_store

COOKIE = "hpc_ui_token_{port}"  # per port: a browser shares 127.0.0.1's cookies across ports
START_TIMEOUT_S = 120.0
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "content-length",
}


class UiError(VerbError):
    pass


def tracking_uri(path: Path) -> str:
    """The MLflow store of a run directory (its tracking.json), of a runs folder (its embedded store) or a store
    file itself: ``sqlite:///...`` or a server's URL."""
    if path.is_file() and path.name.endswith(".db"):
        return f"sqlite:///{path.absolute()}"
    if not path.is_dir():
        raise UiError(f"{path} is neither a runs folder, a run directory nor an MLflow store (.db).")
    run = RunDir(path)
    if run.config.is_file():
        try:
            uri = json.loads(run.tracking.read_text()).get("uri")
        except (OSError, ValueError):
            uri = None
        if not uri:
            raise UiError(f"{run.tracking} is missing or unreadable: the run {path} was not tracked in MLflow.")
        return str(uri)
    for store in (default_store(path.absolute()), path.absolute() / STORE_NAME):
        if store.is_file():
            return f"sqlite:///{store}"
    raise UiError(
        f"{path} holds no MLflow store ({STORE_NAME}, or .mlflow-USER/{STORE_NAME} in a shared folder): give the "
        "runs folder the runs were tracked beside, a run directory, or the store file."
    )


def own_store(uri: str) -> Path:
    """An embedded store's file, refused when it is a link or another user's, or lies in a folder others may write
    (they could plant a journal that SQLite replays into it): the server migrates and writes it."""
    store = Path(uri.removeprefix("sqlite:///"))
    if store.is_symlink() or not store.is_file() or store.stat().st_uid != os.geteuid():
        raise UiError(f"{store} is a link, missing, or another user's file: the UI opens only your own store.")
    folder = os.stat(store.parent)
    if folder.st_uid != os.geteuid() or folder.st_mode & 0o022:
        raise UiError(
            f"{store.parent} is another user's folder or others may write it: the UI opens a store only in a folder "
            "of your own (a shared runs folder keeps yours in .mlflow-USER/)."
        )
    return store


def mlflow_problem() -> str | None:
    spec = importlib.util.find_spec("mlflow")
    if spec is None or importlib.util.find_spec("mlflow.server") is None or spec.origin is None:
        return "the MLflow UI needs the full mlflow package: pip install -e '.[ui]' (mlflow-skinny has no server)"
    if not (Path(spec.origin).parent / "server" / "js" / "build" / "index.html").is_file():
        return "this mlflow package has no UI files (mlflow/server/js/build): pip install -e '.[ui]'"
    return None


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 60.0) -> None:
        super().__init__("127.0.0.1", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def _cookie(header: str, name: str) -> str:
    """The value of cookie ``name`` in a Cookie header, parsed leniently (one malformed cookie of another local
    service must not hide this one)."""
    for part in header.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return ""


def _same(given: str, token: str) -> bool:
    return secrets.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode())


def make_handler(socket_path: str, token: str, cookie: str) -> type[http.server.BaseHTTPRequestHandler]:
    class Proxy(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet: the terminal shows the URL only
            pass

        def _allowed(self) -> bool:
            return _same(_cookie(self.headers.get("Cookie", ""), cookie), token)

        def _reply(self, status: int, text: str, headers: dict[str, str] | None = None) -> None:
            body = text.encode()
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _handle(self) -> None:
            parts = urlsplit(self.path)
            query = parse_qsl(parts.query, keep_blank_values=True)
            given = dict(query).get("token")
            if given is not None:  # the printed URL: set the cookie, then the same page without the token
                if not _same(given, token):
                    self._reply(403, "hpc ui: wrong token\n")
                    return
                rest = urlencode([(k, v) for k, v in query if k != "token"])
                setting = f"{cookie}={token}; Path=/; HttpOnly; SameSite=Strict"
                self._reply(302, "", {"Location": parts.path + (f"?{rest}" if rest else ""), "Set-Cookie": setting})
                return
            if not self._allowed():
                self._reply(403, "hpc ui: open the URL `python -m hpc ui` printed (it carries the session's token)\n")
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                self._reply(400, "hpc ui: a Content-Length that is not a number\n")
                return
            body = self.rfile.read(length) if length > 0 else None
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP and k.lower() != "cookie"}
            conn = UnixConnection(socket_path)
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                answer = conn.getresponse()
                data = answer.read()
            except (OSError, http.client.HTTPException) as exc:
                self._reply(502, f"hpc ui: the MLflow server did not answer: {exc!r}\n")
                return
            finally:
                conn.close()
            self.send_response(answer.status, answer.reason)
            for k, v in answer.getheaders():
                if k.lower() not in HOP_BY_HOP:
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":  # a HEAD answer has no body
                self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _handle

    return Proxy


def _wait_for(sock_path: Path, server: subprocess.Popen, log: Path, stop: threading.Event) -> None:
    """Until the server answers on its socket, or a signal asked to stop."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and not stop.is_set():
        if server.poll() is not None:
            raise UiError(f"the MLflow server exited at start:\n{_tail(log)}")
        if sock_path.exists():
            conn = UnixConnection(str(sock_path), timeout=5)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            finally:
                conn.close()
        stop.wait(0.2)
    if stop.is_set():
        return
    raise UiError(f"the MLflow server did not answer within {START_TIMEOUT_S:.0f} s:\n{_tail(log)}")


def _tail(log: Path, lines: int = 8) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def main(path: str, *, host: str = "127.0.0.1", port: int = 0) -> int:
    uri = tracking_uri(Path(path))
    if uri.startswith(("http://", "https://")):
        print(f"the runs are tracked by the MLflow server {uri}: open it there (its own UI)")
        return 0
    if not uri.startswith("sqlite:///"):
        raise UiError(f"{path}: tracking URI {uri!r} is not an embedded store or a server the UI can open.")
    store = own_store(uri)
    problem = mlflow_problem()
    if problem:
        raise UiError(problem)
    token = secrets.token_urlsafe(24)
    state = Path(tempfile.mkdtemp(prefix="hpc-ui-"))  # 0700: only this user reaches the socket
    sock_path, log = state / "mlflow.sock", state / "mlflow.log"
    try:
        proxy = http.server.ThreadingHTTPServer((host, port), None)  # the handler, once the port is known
    except OSError as exc:
        shutil.rmtree(state, ignore_errors=True)
        raise UiError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (choose another --port)") from None
    proxy.RequestHandlerClass = make_handler(str(sock_path), token, COOKIE.format(port=proxy.server_address[1]))
    proxy.daemon_threads = True
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())  # only a flag: the main thread shuts down
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{store}"]
    command += ["--workers", "1", "--uvicorn-opts", f"--uds {shlex.quote(str(sock_path))}"]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    try:
        with open(log, "ab") as out:
            server = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
    except OSError as exc:
        proxy.server_close()
        shutil.rmtree(state, ignore_errors=True)
        raise UiError(f"cannot start the MLflow server: {exc}") from None
    serving = False
    try:
        _wait_for(sock_path, server, log, stop)
        if stop.is_set():
            return 0
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        serving = True
        shown = proxy.server_address[1]
        print(f"MLflow UI of {store}: http://{host}:{shown}/?token={token}", flush=True)
        print(
            f"  from your own machine: ssh -N -L {shown}:127.0.0.1:{shown} {socket.gethostname()}, then open that "
            "URL; Ctrl-C here ends it",
            flush=True,
        )
        while not stop.wait(1.0):
            if server.poll() is not None:
                raise UiError(f"the MLflow server ended (status {server.returncode}):\n{_tail(log)}")
    finally:
        if serving:
            proxy.shutdown()
        proxy.server_close()
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        shutil.rmtree(state, ignore_errors=True)
    return 0
