"""Procedural agent sessions: the embedded default for demos, tests and users without recordings.

The recorded workloads cannot ship inside the package, so the generator reproduces their
shape instead of their text. Per source family (tau2 and tau-bench customer service,
SWE-agent coding) it samples the number of turns, the characters newly appended before
each request (by turn kind) and the output length from quantiles measured on the
recordings (`ostinato/data/session_stats.json`, written by `record_stats.write_stats`),
and fills those lengths with made-up agent-like text: policies, JSON records, tool calls,
shell and file output, tracebacks, user follow-ups. What a routing profile or a prefill benchmark sees
(how much is new per request, how much is decoded, how often a tool is called) follows
the real sessions; the words do not. The same (n, seed) gives the same sessions in every
process. Lengths are characters (about 4 per token).
"""

from ostinato.sessions.synthetic.generator import generate_sessions

__all__ = ["generate_sessions"]
