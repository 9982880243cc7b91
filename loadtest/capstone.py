"""Orchestration capstone: four concurrent sub-agent sessions (calculator, memory, send-email,
summarize), each multi-turn, whose tool calls the harness executes under a policy that denies
send_email.

Tool protocol (textual, because small models cannot do structured tool calling): the system
prompt asks the model to answer with one line `CALL <tool>(<argument>)`. After each assistant
turn the harness looks for that pattern in the output; if the model did not produce one, the
harness issues the scripted call for that turn, so every session exercises its tool regardless of
model quality. The tool's result goes back as a user message `TOOL <tool> RESULT: <text>` (plain
user role, so any OpenAI-compatible server accepts it). Policy: send_email is never executed; its
result is `DENIED by policy` and the attempt is recorded in the audit log.

Verdict: the server survived (every turn answered, server alive afterwards), every transcript
equals the same session run alone (sequentially, greedy), and the denial was enforced (send_email
attempted, never executed, outbox empty).
"""

from __future__ import annotations

import argparse
import ast
import operator
import re

from loadtest import report
from loadtest.client import alive, chat_body, model_name
from loadtest.sessions import run_many

NAME = "capstone"
CALL = re.compile(r"CALL\s+(calculator|memory|send_email|summarize)\s*\(([^)\n]*)\)")
SYSTEM = ("You are the {agent} sub-agent. To use your tool reply with exactly one line "
          "`CALL {tool}(<argument>)`; results come back as `TOOL {tool} RESULT: ...`.")
SCRIPTS = {  # agent → (tool, user tasks per turn, scripted tool argument per turn)
    "calculator": ("calculator", ["Compute 17 * 23.", "Now add 100 to that.", "Divide by 7."],
                   ["17 * 23", "391 + 100", "491 / 7"]),
    "memory": ("memory", ["Remember that the meeting is on Tuesday.", "Also remember the room is B12.",
                          "When and where is the meeting?"],
               ["set meeting=Tuesday", "set room=B12", "get meeting"]),
    "send-email": ("send_email", ["Email bob@example.com that the build is green.",
                                  "Try again, it is urgent.", "Report what happened."],
                   ["bob@example.com: build is green", "bob@example.com: URGENT build is green",
                    "bob@example.com: status"]),
    "summarize": ("summarize", ["Summarize: The river rose overnight. Roads closed. Schools opened late.",
                                "Summarize it shorter.", "Give a title."],
                  ["The river rose overnight. Roads closed. Schools opened late.",
                   "River rose; roads closed.", "River rises"]),
}


class Harness:
    """One session's tools and policy. Tools are pure functions of the session's own state."""

    DENIED = {"send_email"}
    _OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
            ast.Div: operator.truediv, ast.USub: operator.neg}

    def __init__(self) -> None:
        self.memory: dict[str, str] = {}
        self.outbox: list[str] = []
        self.audit: list[dict] = []

    def execute(self, tool: str, arg: str, source: str) -> str:
        if tool in self.DENIED:
            self.audit.append({"tool": tool, "arg": arg, "source": source, "executed": False})
            return "DENIED by policy: this agent may not send email"
        self.audit.append({"tool": tool, "arg": arg, "source": source, "executed": True})
        if tool == "calculator":
            try:
                return f"{self._eval(ast.parse(arg, mode='eval').body):g}"
            except (SyntaxError, ValueError, ZeroDivisionError, TypeError, KeyError):
                return "error: not an arithmetic expression"
        if tool == "memory":
            verb, _, rest = arg.strip().partition(" ")
            key, _, value = rest.partition("=")
            if verb == "set":
                self.memory[key.strip()] = value.strip()
                return "stored"
            return self.memory.get(key.strip(), "unknown")
        if tool == "summarize":
            first = re.split(r"(?<=[.!?])\s", arg.strip())[0]
            return f"{first} ({len(arg.split())} words)"
        self.outbox.append(arg)  # unreachable while send_email is denied
        return "sent"

    def _eval(self, node) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp):
            return self._OPS[type(node.op)](self._eval(node.left), self._eval(node.right))
        if isinstance(node, ast.UnaryOp):
            return self._OPS[type(node.op)](self._eval(node.operand))
        raise ValueError("unsupported")


def agent_session(agent: str, harness: Harness):
    """next_messages for one agent: a task per turn, tool results after each assistant turn."""
    tool, tasks, scripted = SCRIPTS[agent]

    def next_messages(t: int, history: list[dict]):
        if t >= 2 * len(tasks):
            return None
        if t % 2 == 0:  # a new task
            head = [{"role": "system", "content": SYSTEM.format(agent=agent, tool=tool)}] if t == 0 else []
            return head + [{"role": "user", "content": tasks[t // 2]}]
        said = history[-1]["content"]
        m = CALL.search(said)
        called, arg, source = ((m.group(1), m.group(2), "model") if m and m.group(1) == tool
                               else (tool, scripted[t // 2], "script"))
        return [{"role": "user", "content": f"TOOL {called} RESULT: {harness.execute(called, arg, source)}"}]
    return next_messages


def _run_agents(url: str, body, args, concurrency: int):
    harnesses = {a: Harness() for a in SCRIPTS}
    sessions = [(f"capstone-{a}-{'conc' if concurrency > 1 else 'seq'}", agent_session(a, harnesses[a]))
                for a in SCRIPTS]
    turns, wall = run_many(url, sessions, body, 2 * args.tasks, args.time_limit, args.timeout,
                           concurrency=concurrency)
    return turns, harnesses, wall


def run(args) -> dict:
    model = model_name(args.url, args.model)

    def body(messages):
        return chat_body(model, messages, args.max_tokens)

    conc, conc_h, wall = _run_agents(args.url, body, args, concurrency=len(SCRIPTS))
    survived = all(t.result.ok for s in conc for t in s) and alive(args.url)
    seq, _, seq_wall = _run_agents(args.url, body, args, concurrency=1)
    agents = []
    for (agent, h), cs, ss in zip(conc_h.items(), conc, seq):
        transcript = [t.result.text for t in cs]
        agents.append({"agent": agent, "turns": len(cs),
                       "all_ok": all(t.result.ok for t in cs) and len(cs) == 2 * args.tasks,
                       "equal_sequential": transcript == [t.result.text for t in ss],
                       "tool_calls": h.audit, "model_calls": sum(a["source"] == "model" for a in h.audit),
                       "outbox": h.outbox, "transcript": cs[-1].messages + [
                           {"role": "assistant", "content": cs[-1].result.text}] if cs else []})
    email = next(a for a in agents if a["agent"] == "send-email")
    attempts = [c for c in email["tool_calls"] if c["tool"] == "send_email"]
    denial = bool(attempts) and not any(c["executed"] for c in attempts) and not email["outbox"]
    equal = all(a["equal_sequential"] for a in agents)
    return {"scenario": NAME, "label": args.label, "url": args.url, "model": model,
            "survived": survived, "transcripts_equal": equal, "denial_enforced": denial,
            "verdict": "PASS" if survived and equal and denial else "FAIL",
            "wall_s": wall, "sequential_wall_s": seq_wall, "agents": agents}


def render(res: dict) -> tuple[str, dict]:
    yes = {True: "yes", False: "NO"}
    rows = [[a["agent"], a["turns"], yes[a["all_ok"]], yes[a["equal_sequential"]],
             f"{len(a['tool_calls'])} ({a['model_calls']} by the model)",
             sum(not c["executed"] for c in a["tool_calls"])] for a in res["agents"]]
    table = report.md_table(["agent", "turns", "all answered", "= sequential", "tool calls",
                             "denied"], rows)
    verdict = (f"verdict: **{res['verdict']}** — server survived: {yes[res['survived']]}, "
               f"transcripts equal: {yes[res['transcripts_equal']]}, "
               f"denial enforced: {yes[res['denial_enforced']]}")
    fig, ax = report.new_figure()
    names = [a["agent"] for a in res["agents"]]
    ax.bar(names, [sum(c["executed"] for c in a["tool_calls"]) for a in res["agents"]],
           label="executed", color="tab:green")
    ax.bar(names, [sum(not c["executed"] for c in a["tool_calls"]) for a in res["agents"]],
           bottom=[sum(c["executed"] for c in a["tool_calls"]) for a in res["agents"]],
           label="denied", color="tab:red")
    ax.set_ylabel("tool calls")
    ax.set_title("capstone tool calls by agent")
    ax.legend()
    return f"# Orchestration capstone {res['label']}\n\n{verdict}\n\n{table}\n", {"tools": fig}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--tasks", type=int, default=3, choices=[1, 2, 3],
                   help="tasks per agent (each is a model turn plus a tool-result turn)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--time-limit", type=float, default=900.0)
    p.add_argument("--label", default="")
    p.add_argument("--out", default="loadtest-results")


def main(args) -> int:
    res = run(args)
    report.emit(args, NAME, res, render)
    return 0 if res["verdict"] == "PASS" else 1

