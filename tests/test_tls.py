"""TLS on the gRPC port with TF Serving's --ssl_config_file, mutual TLS included, against a
real pool and the official client. Certificates are made here with the `openssl` command."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from mpspool.config import ConfigError, tls_from
from mpspool.demo_model import demo_inputs

from conftest import DEMO_ROWS
from poolproc import Pool


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _signed(name: str, usage: str, cwd: Path) -> None:
    """name.key and name.pem: a P-256 key and its certificate for localhost, signed by ca."""
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", "/CN=localhost", cwd=cwd,
    )  # fmt: skip
    (cwd / f"{name}.ext").write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
        f"keyUsage=digitalSignature\nextendedKeyUsage={usage}\n"
    )
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext",
        cwd=cwd,
    )  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=mpspool test CA", cwd=d,
    )  # fmt: skip
    _signed("server", "serverAuth", d)
    _signed("client", "clientAuth", d)
    # A CA of its own, which did not sign the server: a client trusting only it must fail.
    other = d / "other"
    other.mkdir()
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=someone else", cwd=other,
    )  # fmt: skip
    return d


def _ssl_config(certs: Path, client_verify: bool) -> str:
    def pem(name: str) -> str:
        return (certs / name).read_text().replace("\n", "\\n")

    return (
        f'server_key: "{pem("server.key")}"\n'
        f'server_cert: "{pem("server.pem")}"\n'
        f'custom_ca: "{pem("ca.pem")}"\n'
        f"client_verify: {'true' if client_verify else 'false'}\n"
    )


@pytest.fixture(scope="module")
def pool(
    tmp_path_factory: pytest.TempPathFactory, certs: Path, demo_model_dir: Path
) -> Iterator[Pool]:
    tmp = tmp_path_factory.mktemp("tls")
    config = tmp / "ssl.config"
    config.write_text(_ssl_config(certs, client_verify=True))
    socket_path = f"/tmp/mpspool-tls-{os.getpid()}.sock"  # short: a socket path's limit
    pool = Pool(
        tmp, demo_model_dir, 1, "--ssl_config_file", str(config), "--grpc_socket_path", socket_path
    )
    try:
        pool.start().wait_ready(1)
        yield pool
        assert pool.stop() == 0
    finally:
        pool.kill()
        Path(socket_path).unlink(missing_ok=True)


def _predict(pool: Pool, credentials: grpc.ChannelCredentials | None, target: str = "") -> None:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "demo"
    for name, array in demo_inputs(2, DEMO_ROWS, seed=1).items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(array))
    target = target or f"127.0.0.1:{pool.port}"
    options = [("grpc.ssl_target_name_override", "localhost")]
    channel: grpc.Channel
    if credentials is None:
        channel = grpc.insecure_channel(target)
    else:
        channel = grpc.secure_channel(target, credentials, options=options)
    with channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        response = stub.Predict(request, timeout=10)
    assert response.outputs["score"].tensor_shape.dim[0].size == 2


def _credentials(certs: Path, ca: str = "ca.pem", client: bool = True) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=(certs / ca).read_bytes(),
        private_key=(certs / "client.key").read_bytes() if client else None,
        certificate_chain=(certs / "client.pem").read_bytes() if client else None,
    )


def test_mutual_tls_serves_a_client_with_its_certificate(pool: Pool, certs: Path) -> None:
    _predict(pool, _credentials(certs))


def test_the_unix_socket_takes_tls_as_the_port_does(pool: Pool, certs: Path) -> None:
    # TF Serving applies --ssl_config_file to --grpc_socket_path too; the C core's own
    # :authority (the socket's path) is fixed on the decrypted frames.
    target = pool.status()["pool"]["grpc_socket"]
    _predict(pool, _credentials(certs), target)
    with pytest.raises(grpc.RpcError) as info:
        _predict(pool, None, target)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()


@pytest.mark.parametrize(
    "how",
    ["plaintext", "without a client certificate", "trusting another CA"],
)
def test_clients_that_cannot_prove_themselves_are_refused(
    pool: Pool, certs: Path, how: str
) -> None:
    credentials = {
        "plaintext": None,
        "without a client certificate": _credentials(certs, client=False),
        "trusting another CA": _credentials(certs, ca="other/ca.pem"),
    }[how]
    with pytest.raises(grpc.RpcError) as info:
        _predict(pool, credentials)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    # A refused handshake costs nothing but that connection.
    _predict(pool, _credentials(certs))


def test_ssl_config_files_are_checked_as_tf_serving_needs_them(tmp_path: Path, certs: Path):
    config = tmp_path / "ssl.config"
    config.write_text(_ssl_config(certs, client_verify=False))
    tls = tls_from(config)
    assert tls["server_cert"].startswith("-----BEGIN CERTIFICATE-----")
    assert tls["client_verify"] is False
    config.write_text('server_key: "k"\nclient_verify: true\n')
    with pytest.raises(ConfigError, match="server_key and server_cert are required"):
        tls_from(config)
    config.write_text('server_key: "k"\nserver_cert: "c"\nclient_verify: true\n')
    with pytest.raises(ConfigError, match="client_verify needs custom_ca"):
        tls_from(config)
    config.write_text("server_keys: 1")
    with pytest.raises(ConfigError, match="is not an SSLConfig"):
        tls_from(config)
    # What the front door would refuse, refused before anything starts (exit 2, one line).
    good = _ssl_config(certs, client_verify=True)
    ca = (certs / "ca.pem").read_text()
    for wrong, match in (
        (
            good.replace(ca.replace("\n", "\\n"), "not a certificate"),
            "custom_ca: no PEM certificate",
        ),
        (good.replace("PRIVATE KEY-----", "ENCRYPTED PRIVATE KEY-----"), "server_key is encrypted"),
    ):
        config.write_text(wrong)
        with pytest.raises(ConfigError, match=match):
            tls_from(config)
    config.write_text('server_key: "k"\nserver_cert: "c"\n')
    with pytest.raises(ConfigError, match="server_key: no PEM private key in it"):
        tls_from(config)
