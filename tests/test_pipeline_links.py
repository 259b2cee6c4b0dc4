"""The direct channel's TCP links, in-process (no Ray): frames through two stages and back, error
frames for a bad step, a wrong token refused, an oversized frame closing the link, and mutual TLS
with Ray's certificate variables."""

from __future__ import annotations

import shutil
import socket
import subprocess

import numpy as np
import pytest

from conftest import save_example
from dist_runtime.errors import StageUnavailableError, TransportError
from dist_runtime.examples import LlamaConfig
from dist_runtime.executor import GraphExecutor
from dist_runtime.model import load_model
from dist_runtime.pipeline import links
from dist_runtime.pipeline.launch import make_plan
from dist_runtime.pipeline.stage import StageWorker
from dist_runtime.pipeline.subgraph import stages_for_plan
from dist_runtime.transport import decode_message, encode_message

CFG = LlamaConfig(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64)
TOKEN = b"k" * links.TOKEN_BYTES


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("links") / "tiny2.model"
    save_example(path, CFG, seed=5)
    return path


def _pipeline(model_path):
    """Two in-process stages joined by links: returns (send socket, receive socket, closers)."""
    with load_model(model_path, tensors=[]) as model:
        stages = stages_for_plan(model.graph, make_plan(model.graph, stages=2, max_context=32))
    workers = [StageWorker(st, fuse=False) for st in stages]
    for w in workers:
        w.load_file(str(model_path))
    stage_links = [links.StageLink(k, w.step, TOKEN) for k, w in enumerate(workers)]
    driver = links.Acceptor("127.0.0.1", TOKEN, timeout=10)
    stage_links[0].connect_downstream(*stage_links[1].address)
    stage_links[1].connect_downstream(*driver.address)
    up = links.connect(*stage_links[0].address, TOKEN)
    return up, driver.wait(10), stage_links


def _message(tokens, session, pos, step):
    return encode_message({"tokens": np.asarray(tokens, np.int32)},
                          {"session": session, "pos": pos, "step": step, "logits": "all"})


def _exchange(model_path):
    up, down, stage_links = _pipeline(model_path)
    try:
        with load_model(model_path) as model:
            ref = GraphExecutor(model, fuse=False)
            feeds = [("a", [1, 2, 3], 0), ("b", [4], 0), ("a", [5], 3)]
            for step, (sid, tokens, pos) in enumerate(feeds):  # several in flight at once
                links.send_frame(up, _message(tokens, sid, pos, step))
            links.send_frame(up, b"\xc1 junk")
            for sid, tokens, pos in feeds:
                frame = links.recv_frame(down)
                assert links.frame_error(frame) is None
                want = ref.run({"tokens": np.array(tokens, np.int32)}, session=sid, pos=pos)["logits"]
                np.testing.assert_allclose(decode_message(frame)[0]["logits"], want, atol=1e-5)
            error = links.frame_error(links.recv_frame(down))  # one reply per frame, in order
            assert isinstance(error, TransportError) and "stage 0" in str(error)
            # the links keep serving after a bad frame
            links.send_frame(up, _message([6], "b", 1, 9))
            assert links.frame_error(links.recv_frame(down)) is None
            # a frame that claims more than the limit closes the link (the stream cannot be trusted)
            up.sendall(links._LEN.pack(links.MAX_FRAME + 1))
            with pytest.raises(links.LinkClosed):
                down.settimeout(10)
                links.recv_frame(down)
    finally:
        up.close()
        down.close()
        for link in stage_links:
            link.close()


def test_frames_through_two_stages(model_path):
    _exchange(model_path)


def test_wrong_token_is_refused():
    server = links.listen("127.0.0.1")
    intruder = socket.create_connection(server.getsockname()[:2])
    intruder.sendall(links.MAGIC + b"x" * links.TOKEN_BYTES)
    # the intruder is dropped and nobody else comes: the documented timeout error, nothing else
    with pytest.raises(StageUnavailableError, match="no authenticated connection within 0.5 s"):
        links.accept_authenticated(server, TOKEN, timeout=0.5)
    intruder.settimeout(5)
    assert intruder.recv(1) == b""  # closed on us
    friend = links.connect(*server.getsockname()[:2], TOKEN)
    conn = links.accept_authenticated(server, TOKEN, timeout=5)
    links.send_frame(friend, b"hello")
    assert links.recv_frame(conn) == b"hello"
    for s in (intruder, friend, conn, server):
        s.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_mutual_tls_with_rays_certificate_variables(model_path, tmp_path, monkeypatch):
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp_path)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
        "-keyout", "ca.key", "-out", "ca.crt")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=node", "-keyout", "node.key", "-out", "node.csr")
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "1", "-out", "node.crt")
    monkeypatch.setenv("RAY_USE_TLS", "1")
    monkeypatch.setenv("RAY_TLS_SERVER_CERT", str(tmp_path / "node.crt"))
    monkeypatch.setenv("RAY_TLS_SERVER_KEY", str(tmp_path / "node.key"))
    monkeypatch.setenv("RAY_TLS_CA_CERT", str(tmp_path / "ca.crt"))
    _exchange(model_path)
    # a peer without a certificate of the cluster's CA does not get through the handshake
    server = links.listen("127.0.0.1")
    plain = socket.create_connection(server.getsockname()[:2])
    plain.sendall(links.MAGIC + TOKEN)
    with pytest.raises(StageUnavailableError, match="no authenticated connection within 1 s"):
        links.accept_authenticated(server, TOKEN, timeout=1)
    plain.close()
    server.close()
