"""`duplexd bench relay`'s own parts: the delaying proxy (a real socket each side) and the summary's keys."""

from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from duplexd.bench.dual_path import DelayingProxy, Run, summarize, table, targets

CHUNKS = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]


class _Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, bytes]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Upstream.seen.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for chunk in CHUNKS:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
            time.sleep(0.05)
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, format: str, *args: object) -> None:
        pass


def _post(url: str) -> tuple[float, bytes, int]:
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    t0 = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body=b'{"stream": true}', headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return time.monotonic() - t0, body, response.status


def test_the_proxy_holds_each_request_back_then_streams_the_answer_through() -> None:
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    try:
        with DelayingProxy(f"http://127.0.0.1:{upstream.server_address[1]}/v1") as proxy:
            assert proxy.url.endswith("/v1")
            fast, body, status = _post(proxy.url)
            assert status == 200 and body == b"".join(CHUNKS)
            proxy.delay_ms = 400
            slow, body, _ = _post(proxy.url)
            assert body == b"".join(CHUNKS)
            assert slow - fast >= 0.35, (fast, slow)  # (the delay, whatever the streaming took)
            assert proxy.requests == 2
        assert _Upstream.seen[-1] == ("/v1/chat/completions", b'{"stream": true}')
    finally:
        upstream.shutdown()
        upstream.server_close()


def _run(mode: str, clip: str, reply: str, prefix: str | None = None, audio: float = 1.0, **kw: object) -> Run:
    fields = {
        "mode": mode,
        "delay_ms": 600,
        "clip": clip,
        "turn_text": "What is the capital of France?",
        "reply_text": reply,
        "done_text": reply,
        "prefix": prefix,
        "eos_to_first_audio_s": audio,
        "turn_end_to_first_audio_s": audio - 0.8,
    }
    return Run(**(fields | kw))  # type: ignore[arg-type]


def test_the_summary_counts_prefixes_seams_and_sameness() -> None:
    runs = [
        _run("local", "a", "Paris.", audio=1.0),
        _run("local", "b", "Blue.", audio=1.2),
        _run("remote", "a", "The capital of France is Paris.", audio=2.0),
        _run("remote", "b", "Red, green and blue.", audio=2.2),
        _run("relay", "a", "The capital of France is Paris.", prefix="The capital of", audio=1.05),
        # a seam that dropped a word: the deltas do not begin with the prefix
        _run("relay", "b", "Red and blue.", prefix="Red, green", audio=1.1, done_text="Red and blue."),
    ]
    summary = summarize(runs)
    relay = summary["relay"]["600"]
    assert relay["prefix_accept_rate"] == 1.0 and relay["prefix_words_mean"] == 2.5
    assert relay["seam_exact"] == 0.5
    assert relay["same_as_remote"] == 0.5 and relay["same_as_remote_compared"] == 2
    assert summary["local"]["600"]["eos_to_first_audio_p50_s"] == 1.1
    t = targets(summary)
    assert t["relay_over_local_eos_to_first_audio"] == {"600": round(1.075 / 1.1, 3)}
    assert t["relay_below_remote_at_longest_delay"] == round(1 - 1.075 / 2.1, 3)
    printed = table({"delays_ms": [600], **summary, "targets": t, "remote_server": "x"})
    assert "| 600 ms | relay | 1.08 / 1.10 |" in printed and "seam exact 0.5" in printed, printed
    # --baseline's relay_at_once is summarized as relay is, and only when it ran
    assert "relay_at_once" not in summary
    asked = summarize(runs + [_run("relay_at_once", "a", "The capital of France is Paris.", prefix="The", audio=1.5)])
    assert asked["relay_at_once"]["600"]["prefix_accept_rate"] == 1.0 and asked["relay_at_once"]["600"]["n"] == 1
    # a reply with no prefix (the local model sure of nothing) is still a seam-exact reply of the remote model's
    alone = summarize([_run("relay", "a", "Paris.", prefix="")])["relay"]["600"]
    assert alone["prefix_accept_rate"] == 0.0 and alone["prefix_words_mean"] is None and alone["seam_exact"] == 1.0
