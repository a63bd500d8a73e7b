"""`ostinato serve`: the OpenAI- and Anthropic-compatible server over one session slot.

The model and placement flags (--model, --device, --dtype, --max-context, --residency,
--gpu-memory, ...) are the shared ones of `ostinato generate`; this adds the network side, and
the plan serve makes for itself when given a cap and no residency (jobs/serve_plan.py).

The model loads on the engine thread while the HTTP server already answers /health; a load
that fails stops the server, and the command exits with the load's error (2 for one the user
can fix, through the CLI's error line; 1 with a traceback otherwise), so that a supervisor sees
the failure instead of a server answering 500.
"""
from __future__ import annotations

import argparse
import ipaddress
import sys
from pathlib import Path

from ostinato.config import ConfigError, parse_bytes
from ostinato.model_args import add_model_args, placement_settings, runner_settings
from ostinato.jobs.serve_plan import DEFAULT_SESSIONS, AutoPlan
from ostinato.server.parsing import FORMATS


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _size(text: str) -> int:
    try:
        size = parse_bytes(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if size < 1:
        raise argparse.ArgumentTypeError("the size must be at least 1 byte")
    return size


def cmd_serve(a) -> int:
    import uvicorn

    from ostinato.server.app import build_app

    if a.model and a.model_arg and a.model != a.model_arg:
        raise ConfigError(f"two models given ({a.model_arg} and --model {a.model}): give one")
    a.model = a.model or a.model_arg
    if not a.model:
        raise ConfigError("give the model to serve: `ostinato serve MODEL` (a checkpoint directory, a .gguf file or "
                          "synth:PRESET)")

    placement = placement_settings(a)  # a bad --gpu-memory fails here, before the port is bound
    if placement.residency and not Path(placement.residency).is_file():
        raise FileNotFoundError(f"--residency {placement.residency}: no such file (write one with `ostinato plan`)")
    if a.replan and placement.residency:
        raise ConfigError("--replan makes the plan serve keeps in its cache: give it without --residency "
                          "(plan a file of your own again with `ostinato plan --from-served`)")
    auto = AutoPlan(sessions=a.sessions or DEFAULT_SESSIONS, replan=a.replan)
    app = build_app(a.model, runner_settings(a), placement, a.api_key, a.served_model_name,
                    tool_call_parser=a.tool_call_parser, max_body_size=a.max_body_size,
                    conversations=a.kv_conversations, conversation_bytes=a.kv_cache_memory,
                    url=f"http://{a.host}:{a.port}", auto_plan=auto, learn=not a.no_learn)
    if not _is_loopback(a.host) and not a.api_key:
        print(f"ostinato: warning: serving on {a.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level))
    worker = app.state.worker

    def stop(error: Exception) -> None:  # on the engine thread; uvicorn's loop checks the flag
        server.should_exit = True

    worker.on_failed = stop
    server.run()
    if worker.exception is not None:
        raise worker.exception  # the CLI prints a user's error in one line, anything else with its traceback
    return 0


def add_server_commands(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over OpenAI- and Anthropic-compatible HTTP APIs "
                                     "(one session slot)")
    add_model_args(p)
    p.add_argument("model_arg", nargs="?", metavar="MODEL", help="the model, as --model takes it")
    for action in p._actions:  # MODEL or --model
        if action.dest == "model":
            action.required = False
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", help="require this key ('Authorization: Bearer KEY') on the /v1 routes")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="names the model answers to; the first is reported in responses and listed by /v1/models "
                        "(default: the model's directory name)")
    p.add_argument("--tool-call-parser", choices=list(FORMATS),
                   help="how the model writes tool calls (default: chosen from its chat template)")
    p.add_argument("--max-body-size", type=_size, default="16MiB", metavar="SIZE",
                   help="the largest request body accepted, e.g. 16MiB (default); a larger one gets a 413")
    p.add_argument("--kv-conversations", type=int, default=4, metavar="N",
                   help="conversations besides the active one whose KV cache is kept in host memory (page-locked "
                        "with a GPU; each up to the KV cache's size, and one KV cache's worth taken at start-up), "
                        "least recently used dropped first, so that side requests do not make the session prefill "
                        "again; 0: only the active one (default: 4)")
    p.add_argument("--kv-cache-memory", type=_size, metavar="SIZE",
                   help="the most host memory the --kv-conversations copies take together, e.g. 32GiB; the least "
                        "recently used go first to make room, a conversation larger than it is not kept "
                        "(default: no cap but the count; /metrics shows ostinato_kv_conversation_bytes)")
    p.add_argument("--sessions", metavar="SPEC", help="with --gpu-memory and no --residency: the agent sessions "
                   f"to plan on, your own recordings (a file or folder) or generated ones (default {DEFAULT_SESSIONS}); "
                   "the plan is cached under $OSTINATO_CACHE (default ~/.cache/ostinato)")
    p.add_argument("--replan", action="store_true", help="make the cached plan again: from the routes this "
                   "server has served with it, else by profiling --sessions")
    p.add_argument("--no-learn", action="store_true", help="do not count the routes served (kept beside the plan "
                   "for --replan and `ostinato plan --from-served`; one small kernel per MoE layer and pass)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)
