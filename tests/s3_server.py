"""A real S3-compatible server for the tests: moto's server mode, in a process of its own on
loopback, with the credentials clients read from the environment."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from waiting import wait_until

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "rayinfer-test", "AWS_SECRET_ACCESS_KEY": "rayinfer-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """Runs the server and yields its endpoint ("127.0.0.1:<port>"); set :data:`CREDENTIALS`
    in the environment of whoever talks to it."""
    port = _free_port()
    moto = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0
        wait_until(listening, "moto's S3 server to listen", timeout_s=30)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def client(endpoint: str):
    import boto3

    return boto3.session.Session(
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"], aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
    ).client("s3", endpoint_url=f"http://{endpoint}")


def upload_folder(s3, bucket: str, prefix: str, folder: Path) -> None:
    """Every file under ``folder`` as an object ``<prefix>/<relative path>``."""
    for path in sorted(folder.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            s3.put_object(Bucket=bucket, Key=f"{prefix}/{path.relative_to(folder).as_posix()}", Body=path.read_bytes())


