"""The control server's shutdown is not an error: a client connection that the shutdown closes
under its serving thread (which then fails on a descriptor that is gone) is logged at DEBUG,
while the same failure on a running server still propagates to rpyc's error log."""

from __future__ import annotations

import errno
import logging
import socket
import threading

import pytest
import rpyc

from ckptcache.server.service import RPC_CONFIG, CappedThreadedServer
from tests.helpers import wait_until


class _Echo(rpyc.Service):  # type: ignore[misc]
    def exposed_echo(self, x: str) -> str:
        return x


def _server(tmp_path, logger: logging.Logger) -> CappedThreadedServer:
    return CappedThreadedServer(_Echo, socket_path=str(tmp_path / "ctl.sock"), logger=logger,
                                protocol_config=dict(RPC_CONFIG), auto_register=False)  # fmt: skip


def test_a_socket_gone_at_shutdown_is_logged_at_debug(tmp_path, caplog):
    logger = logging.getLogger("test.control.shutdown")
    server = _server(tmp_path, logger)
    try:
        closed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        closed.close()
        with caplog.at_level(logging.DEBUG, logger=logger.name):
            server.active = False  # what close() sets first
            server._serve_client(closed, None)
        assert [r.levelno for r in caplog.records] == [logging.DEBUG]
        assert "closed by the shutdown" in caplog.records[0].getMessage()

        server.active = True  # a running server: not ours to swallow
        with pytest.raises(OSError) as info:
            server._serve_client(closed, None)
        assert info.value.errno == errno.EBADF
    finally:
        server.active = False
        server.close()


def test_closing_under_connected_clients_logs_no_error(tmp_path, caplog):
    logger = logging.getLogger("test.control.clients")
    for round_ in range(5):
        path = tmp_path / f"r{round_}"
        path.mkdir()
        server = _server(path, logger)
        thread = threading.Thread(target=server.start, daemon=True)
        with caplog.at_level(logging.DEBUG, logger=logger.name):
            thread.start()
            wait_until(lambda s=server: s.active, timeout=10)  # listening
            sock = str(path / "ctl.sock")
            conns = [rpyc.utils.factory.unix_connect(sock, config=dict(RPC_CONFIG)) for _ in "abcd"]
            assert [c.root.echo(f"c{i}") for i, c in enumerate(conns)] == ["c0", "c1", "c2", "c3"]
            server.close()
            thread.join(timeout=10)
            for c in conns:
                c.close()
        assert not thread.is_alive()
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == [], [r.getMessage() for r in errors]
