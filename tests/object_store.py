"""A real S3-compatible server for tests: moto's server on a free loopback port, no mocks in-process.

``s3_server()`` starts ``moto.server.ThreadedMotoServer`` on 127.0.0.1, creates a bucket, and points
the standard AWS environment at it (``AWS_ENDPOINT_URL``, dummy credentials, a region) for the test
process and every process it starts afterwards (spawned ranks, a local Ray started inside the block
inherit the environment). On exit the server stops and the environment is restored. Everything goes
through real HTTP and s3fs/aiobotocore, exactly as against a real object store.
"""

from __future__ import annotations

import logging
import os
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
_CLEARED = ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    bucket: str

    def url(self, *keys: str) -> str:
        return "/".join([f"s3://{self.bucket}", *keys])

    @property
    def fs(self):
        """The s3fs filesystem the service itself uses (workers/checkpoints/storage.py), for the test's own looks."""
        from etrain.workers.checkpoints.storage import filesystem

        return filesystem(self.url())[0]


@contextmanager
def s3_server(bucket: str = "etrain-test") -> Iterator[S3Server]:
    pytest.importorskip("s3fs", reason="the s3 tests need the s3 extra (pip install -e '.[dev]')")
    server_module = pytest.importorskip(
        "moto.server", reason="the s3 tests need moto[server] (pip install -e '.[dev]')"
    )
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one INFO line per request otherwise
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {name: os.environ.get(name) for name in (*ENV, "AWS_ENDPOINT_URL", *_CLEARED)}
    os.environ.update(ENV, AWS_ENDPOINT_URL=endpoint)
    for name in _CLEARED:
        os.environ.pop(name, None)
    try:
        _reset(endpoint)  # moto keeps its buckets per process: every server starts empty
        store = S3Server(endpoint=endpoint, bucket=bucket)
        store.fs.mkdir(bucket)
        yield store
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()


def _reset(endpoint: str) -> None:
    request = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()
