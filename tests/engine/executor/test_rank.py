"""engine/executor/rank.py, a tensor-parallel rank's process, in this process: its serve loop over a fake
connection, and its start against a driver that hands it a config it cannot load (the whole ranks run in
tests/engine/executor/test_tensor_parallel.py)."""
import multiprocessing.connection
import threading

from pagoda.engine.executor import rank


class Runner:
    def add(self, a, b):
        return a + b

    def fail(self):
        raise ValueError("bad shard")


class Conn:
    def __init__(self, messages):
        self.messages, self.sent = list(messages), []

    def recv(self):
        if not self.messages:
            raise EOFError  # the driver is gone
        return self.messages.pop(0)

    def send(self, item):
        self.sent.append(item)


def test_a_rank_answers_waited_calls_and_ends_when_told_or_when_the_driver_is_gone():
    conn = Conn([("add", (1, 2), True), ("add", (3, 4), False), None, ("add", (5, 6), True)])
    rank._serve(Runner(), conn)
    assert conn.sent == [(True, 3)] and conn.messages == [("add", (5, 6), True)]  # a step is not answered
    conn = Conn([("add", (1, 1), True)])
    rank._serve(Runner(), conn)  # then EOF: returns
    assert conn.sent == [(True, 2)]


def test_a_failed_call_is_told_to_the_driver_and_ends_the_rank():
    conn = Conn([("fail", (), True), ("add", (1, 2), True)])
    rank._serve(Runner(), conn)
    assert conn.sent == [(False, "ValueError: bad shard")]


def test_a_rank_that_cannot_load_tells_the_driver(monkeypatch):
    key = b"k" * 16
    monkeypatch.setenv("PAGODA_TP_AUTHKEY", key.hex())
    monkeypatch.setattr(rank.signal, "signal", lambda *args: None)  # the test process keeps its handlers
    monkeypatch.setattr(rank.logging, "basicConfig", lambda **kw: None)  # and its logging
    listener = multiprocessing.connection.Listener(("127.0.0.1", 0), authkey=key)
    seen = []

    def driver():
        with listener.accept() as conn:
            seen.append(conn.recv())  # the rank says which it is
            conn.send(("not a config", 0))
            seen.append(conn.recv())

    t = threading.Thread(target=driver)
    t.start()
    host, port = listener.address
    rank.main(["1", f"{host}:{port}"])
    t.join(30)
    listener.close()
    assert seen[0] == 1 and seen[1][0] is False and "AttributeError" in seen[1][1], seen
