"""Locust users doing multi-turn chat sessions over SSE, with the X-Session-ID header.

    locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 60s --host http://127.0.0.1:8000 \
        [--turns 3] [--max-tokens 32] [--max-requests 200] [--lt-out loadtest-results]

The SSE body is read line by line through httpx streaming (locust's own client reads 1 KiB at a
time and would hide the time to first token). Every chat turn fires these locust request events
(request_type "SSE"): "chat" (whole request, ms), "ttft" (ms), "itl" (one per token gap, ms) and
"tokens_per_s" (the response_time field holds tokens/s). At exit the run's JSON, Markdown and PNG
report is written to --lt-out. Runs in its own process: locust monkey-patches sockets, so never
import this module where Ray is initialized.
"""

from __future__ import annotations

import sys
import uuid

# gevent (patched in by locust) removes select.epoll, which trio needs at import; httpcore
# imports trio when it is installed and treats ImportError as "absent". Sync httpx never uses it.
sys.modules.setdefault("trio", None)

import httpx  # noqa: E402
import gevent  # noqa: E402
from locust import User, between, events, task  # noqa: E402
from locust.exception import StopUser  # noqa: E402

from loadtest import report  # noqa: E402
from loadtest.client import chat_body, stream_chat  # noqa: E402

NAME = "locust"
TOPICS = ["rivers", "volcanoes", "bread", "chess", "comets", "bees", "trains", "tea"]


@events.init_command_line_parser.add_listener
def _args(parser) -> None:
    parser.add_argument("--turns", type=int, default=3, help="turns per chat session")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default="", help="default: the first of GET /v1/models")
    parser.add_argument("--max-requests", type=int, default=0,
                        help="stop once this many turns completed (0: run for -t)")
    parser.add_argument("--lt-out", default="loadtest-results", help="report directory")


@events.init.add_listener
def _init(environment, **_) -> None:
    environment.fedserve_samples = {"chat": [], "ttft": [], "itl": [], "tokens_per_s": [],
                                    "errors": [], "requests": 0}


class ChatUser(User):
    """One user = one multi-turn chat session after another, turns back to back."""

    wait_time = between(0.1, 0.5)

    def on_start(self) -> None:
        self.http = httpx.Client(timeout=300)
        opts = self.environment.parsed_options
        self.model = opts.model or self.http.get(f"{self.host}/v1/models").json()["data"][0]["id"]

    def on_stop(self) -> None:
        self.http.close()

    def _fire(self, name: str, value: float, length: int = 0, exc: Exception | None = None) -> None:
        self.environment.events.request.fire(request_type="SSE", name=name, response_time=value,
                                             response_length=length, exception=exc, context={})

    @task
    def session(self) -> None:
        opts = self.environment.parsed_options
        samples = self.environment.fedserve_samples
        sid = f"locust-{uuid.uuid4().hex[:12]}"
        topic = TOPICS[hash(sid) % len(TOPICS)]
        history = [{"role": "system", "content": "You are a concise assistant."}]
        for turn in range(opts.turns):
            if opts.max_requests and len(samples["chat"]) >= opts.max_requests:
                # quit from a greenlet of its own: runner.quit() stops every user, this one
                # too, and would die half-way if called from here
                gevent.spawn(self.environment.runner.quit)
                raise StopUser()
            samples["requests"] += 1
            history.append({"role": "user", "content": f"Tell me one more fact about {topic}."
                            if turn else f"Tell me a fact about {topic}."})
            r = stream_chat(self.http, self.host, chat_body(self.model, history, opts.max_tokens),
                            session=sid, timeout=300)
            if not r.ok:
                samples["errors"].append(r.error or f"HTTP {r.status}")
                self._fire("chat", r.latency_s * 1000, exc=RuntimeError(r.error or f"HTTP {r.status}"))
                return
            self._fire("chat", r.latency_s * 1000, len(r.text))
            samples["chat"].append(r.latency_s)
            if r.ttft_s is not None:
                self._fire("ttft", r.ttft_s * 1000)
                samples["ttft"].append(r.ttft_s)
            for gap in r.itl_s:
                self._fire("itl", gap * 1000)
                samples["itl"].append(gap)
            decode = r.latency_s - (r.ttft_s or 0)
            tokens = r.completion_tokens or len(r.itl_s) + 1
            if decode > 0 and tokens > 1:
                self._fire("tokens_per_s", (tokens - 1) / decode)
                samples["tokens_per_s"].append((tokens - 1) / decode)
            history.append({"role": "assistant", "content": r.text})


@events.quitting.add_listener
def _write_report(environment, **_) -> None:
    s = getattr(environment, "fedserve_samples", None)
    if s is None:
        return
    opts = environment.parsed_options
    res = {"scenario": NAME, "host": opts.host, "users": opts.num_users, "turns": opts.turns,
           "max_tokens": opts.max_tokens, "requests": s["requests"], "completed": len(s["chat"]),
           "errors": s["errors"][:20], "error_count": len(s["errors"]),
           "latency_s": report.percentiles(s["chat"]), "ttft_s": report.percentiles(s["ttft"]),
           "itl_s": report.percentiles(s["itl"]),
           "tokens_per_s": report.percentiles(s["tokens_per_s"])}
    rows = [[k, report.ms(res[k]["p50"]), report.ms(res[k]["p90"]), report.ms(res[k]["p99"]), res[k]["n"]]
            for k in ("latency_s", "ttft_s", "itl_s")]
    tps = res["tokens_per_s"]
    rows.append(["tokens/s per stream", *("-" if tps[p] is None else f"{tps[p]:.1f}"
                                          for p in ("p50", "p90", "p99")), tps["n"]])
    md = (f"# Locust multi-turn chat\n\n{res['completed']}/{res['requests']} turns completed, "
          f"{res['error_count']} errors, {opts.num_users} users, {opts.turns} turns/session\n\n"
          + report.md_table(["metric", "p50", "p90", "p99", "n"], rows))
    figs = {}
    for key in ("ttft", "itl"):
        fig, ax = report.new_figure()
        ax.hist([x * 1000 for x in s[key]] or [0], bins=30)
        ax.set_xlabel(f"{key} (ms)")
        ax.set_ylabel("count")
        ax.set_title(f"{key} distribution")
        figs[key] = fig
    paths = report.write(opts.lt_out, NAME, res, md, figs)
    print(md.split("\n\n", 1)[1])
    print(f"report: {paths['md']}")
