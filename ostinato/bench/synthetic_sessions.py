"""Procedural agent sessions: the embedded default for demos, tests and users without recordings.

The recorded workloads cannot ship inside the package, so the generator reproduces their
shape instead of their text. Per source family (tau2 and tau-bench customer service,
SWE-agent coding) it samples the number of turns, the characters newly appended before
each request (by turn kind) and the output length from quantiles measured on the
recordings (`ostinato/data/session_stats.json`, written by `write_stats`), and fills those
lengths with made-up agent-like text: policies, JSON records, tool calls, shell and file
output, tracebacks, user follow-ups. What a routing profile or a prefill benchmark sees
(how much is new per request, how much is decoded, how often a tool is called) follows
the real sessions; the words do not. The same (n, seed) gives the same sessions in every
process. Lengths are characters (about 4 per token).
"""

from __future__ import annotations

import hashlib
import json
import random
import string
from collections import Counter, defaultdict
from datetime import date
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from ostinato.bench.sessions import KINDS, Message, Session, Turn, load_sessions
from ostinato.bench.text import message_chars, messages_chars

FAMILIES = ("tau2", "tau-bench", "swe-agent")
QUANTILE_LEVELS = tuple(i / 20 for i in range(21))
STATS_PATH = Path(__file__).resolve().parents[1] / "data" / "session_stats.json"


def family_of(session: Session) -> str:
    """The source family: the first component of `source` ("tau2/airline" -> "tau2")."""
    return session.source.split("/", 1)[0]


def quantiles(values: Sequence[float]) -> list[float]:
    """Values at QUANTILE_LEVELS, linearly interpolated (empty input: empty list)."""
    xs = sorted(values)
    out = []
    for q in QUANTILE_LEVELS if xs else ():
        pos = q * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        out.append(round(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo), 1))
    return out


def measure_stats(sessions: Iterable[Session]) -> dict[str, dict]:
    """Per family: quantiles of turns per session, of new characters per turn by kind and
    of output characters (tool-call and text outputs), shares of kinds and of tool calls."""
    groups: dict[str, list[Session]] = defaultdict(list)
    for s in sessions:
        groups[family_of(s)].append(s)
    return {family: _family_stats(group) for family, group in sorted(groups.items())}


def _family_stats(sessions: list[Session]) -> dict:
    new: dict[str, list[int]] = defaultdict(list)
    out: dict[str, list[int]] = defaultdict(list)
    kinds: Counter[str] = Counter()
    for s in sessions:
        for i, turn in enumerate(s.turns):
            kinds[turn.kind] += 1
            new[turn.kind].append(messages_chars(s.new_messages(i)))
            out["tool_call" if turn.output.get("tool_calls") else "text"].append(message_chars(turn.output))
    turns = sum(kinds.values())
    calling = [s for s in sessions if any(t.output.get("tool_calls") for t in s.turns)]
    return {
        "sessions": len(sessions),
        "turns": turns,
        "turns_per_session": quantiles([len(s.turns) for s in sessions]),
        "new_chars": {k: quantiles(v) for k, v in sorted(new.items())},
        "output_chars": {k: quantiles(v) for k, v in sorted(out.items())},
        "tool_call_share": round(len(out.get("tool_call", [])) / max(turns, 1), 4),
        "kind_share": {k: round(kinds[k] / max(turns, 1), 4) for k in KINDS},
        "tool_call_session_share": round(len(calling) / max(len(sessions), 1), 4),
        "tools_chars": quantiles([len(json.dumps(s.tools)) if s.tools else 0 for s in sessions]),
    }


def default_workloads_dir() -> Path:
    """`../shared/workloads` next to the repository that holds this package."""
    return Path(__file__).resolve().parents[3] / "shared" / "workloads"


def write_stats(path: str | Path = STATS_PATH, workloads: str | Path | None = None) -> dict:
    """Measure the recorded workloads and write the statistics the generator samples from."""
    root = Path(workloads) if workloads else default_workloads_dir()
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".json", ".traj", ".jsonl"))
    sessions: list[Session] = []
    sources = []
    for file in files:
        loaded = load_sessions(file)
        sessions += loaded
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        sources.append({"path": file.relative_to(root).as_posix(), "sha256": digest, "sessions": len(loaded)})
    stats = {
        "measured_on": date.today().isoformat(),
        "workloads": "../shared/workloads (see its README for origins and licenses)",
        "written_by": "ostinato.bench.synthetic_sessions.write_stats",
        "units": "characters of message text (content, tool-call names and JSON arguments); about 4 per token",
        "quantile_levels": list(QUANTILE_LEVELS),
        "sources": sources,
        "families": measure_stats(sessions),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(stats, indent=1) + "\n", encoding="utf-8")
    return stats


@lru_cache(maxsize=1)
def load_stats() -> dict:
    """The statistics shipped with the package (`ostinato/data/session_stats.json`)."""
    return json.loads((resources.files("ostinato") / "data" / "session_stats.json").read_text("utf-8"))


class _Lengths:
    """Draws the lengths of one family from its measured quantiles (inverse CDF)."""

    def __init__(self, rng: random.Random, stats: dict) -> None:
        self.rng, self.stats = rng, stats

    def draw(self, q: Sequence[float]) -> float:
        pos = self.rng.random() * (len(q) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(q) - 1)
        return q[lo] + (q[hi] - q[lo]) * (pos - lo)

    def turns(self) -> int:
        return max(1, round(self.draw(self.stats["turns_per_session"])))

    def new(self, kind: str) -> int:
        table = self.stats["new_chars"]
        return max(1, round(self.draw(table.get(kind) or table["tool"])))

    def output(self, tool_call: bool) -> int:
        table = self.stats["output_chars"]
        return max(1, round(self.draw(table.get("tool_call" if tool_call else "text") or table["text"])))


def generate_sessions(n: int, seed: int = 0) -> list[Session]:
    """n sessions cycling through FAMILIES; session i depends only on (seed, i), so a
    longer list extends a shorter one."""
    families = load_stats()["families"]
    sessions = []
    for i in range(n):
        family = FAMILIES[i % len(FAMILIES)]
        rng = random.Random(f"ostinato-synthetic/{seed}/{i}")
        # spread evenly over the family's sessions, for shares that hold in small samples
        spread = (i // len(FAMILIES) * 0.6180339887 + random.Random(seed).random()) % 1.0
        build = _swe_session if family == "swe-agent" else _service_session
        conversation, requests, kinds, tools = build(rng, _Lengths(rng, families[family]), family, spread)
        # request r sends conversation[:r] and is answered by conversation[r]
        turns = [Turn(conversation, conversation[r], k, sent=r) for r, k in zip(requests, kinds)]
        sessions.append(Session(f"synthetic/{seed}/{i:04d}", f"synth-{seed}-{i}",
                                f"{family}/synthetic", tools, turns))
    return sessions


_Built = tuple[list[Message], list[int], list[str], "list[dict] | None"]


def _service_session(rng: random.Random, lengths: _Lengths, family: str, spread: float) -> _Built:
    """A customer-service session (tau2 or tau-bench shape): the agent answers the user
    in text or calls a tool; a text answer is followed by the user, a call by its output.
    `spread` (this session's place in an evenly spread sequence in [0, 1)) picks the domain."""
    domain = _DOMAINS[int(spread * len(_DOMAINS))]
    turns = lengths.turns()
    share = lengths.stats["tool_call_share"]
    p = min(1.0, share * turns / max(turns - 1, 1))  # the last answer is text
    plan = [rng.random() < p for _ in range(turns - 1)] + [False]
    conversation = _service_opening(rng, lengths, domain, family)
    requests, kinds = [], []
    for k, calls in enumerate(plan):
        if k:
            kinds.append("tool" if plan[k - 1] else "user")
            conversation.append(_service_event(rng, lengths, domain, conversation[-1], kinds[-1]))
        else:
            kinds.append("first")
        requests.append(len(conversation))
        conversation.append(_service_output(rng, lengths, domain, calls, final=k == turns - 1))
    return conversation, requests, kinds, domain.tool_schemas()


def _service_opening(rng: random.Random, lengths: _Lengths, domain: _Domain, family: str) -> list[Message]:
    total = lengths.new("first")
    user_len = min(lengths.new("user"), max(total // 4, 20))
    user = {"role": "user", "content": _prose(rng, domain, _USER_SENTENCES, user_len, opening=_USER_OPENING)}
    if family == "tau2":
        system = _service_prompt(rng, domain, total - user_len - len(GREETING))
        return [{"role": "system", "content": system}, {"role": "assistant", "content": GREETING}, user]
    return [{"role": "system", "content": _policy(rng, domain, total - user_len)}, user]


def _service_event(rng: random.Random, lengths: _Lengths, domain: _Domain, last: Message, kind: str) -> Message:
    size = lengths.new(kind)
    if kind == "user":
        return {"role": "user", "content": _prose(rng, domain, _USER_SENTENCES, size)}
    call = last["tool_calls"][0]
    return {"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
            "content": domain.record(rng, size)}


def _service_output(rng: random.Random, lengths: _Lengths, domain: _Domain, calls: bool, final: bool) -> Message:
    size = lengths.output(calls)
    if calls:
        name, arguments = domain.call(rng, size - 1)
        return {"role": "assistant", "content": "", "tool_calls": [_call(rng, name, arguments)]}
    sentences = _FINAL_SENTENCES if final else _AGENT_SENTENCES
    return {"role": "assistant", "content": _prose(rng, domain, sentences, size)}


def _call(rng: random.Random, name: str, arguments: str) -> dict:
    call_id = "call_" + "".join(rng.choice(ID_ALPHABET) for _ in range(24))
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _swe_session(rng: random.Random, lengths: _Lengths, family: str, spread: float) -> _Built:
    """A coding-agent session: function calling (observations as tool messages) in the
    measured share of sessions (chosen by `spread`), otherwise a command in the text and
    observations as user messages. Every request after the first answers an observation."""
    calling = spread < lengths.stats["tool_call_session_share"]
    repo = _Repo(rng)
    total = lengths.new("first")
    issue_len = round(total * rng.uniform(0.15, 0.35))
    conversation: list[Message] = [
        {"role": "system", "content": repo.system_prompt(rng, total - issue_len)},
        {"role": "user", "content": repo.issue(rng, issue_len)},
    ]
    turns = lengths.turns()
    requests = []
    for k in range(turns):
        if k:
            conversation.append(_swe_observation(rng, lengths, repo, conversation[-1], calling))
        requests.append(len(conversation))
        conversation.append(_swe_output(rng, lengths, repo, calling, final=k == turns - 1))
    return conversation, requests, ["first"] + ["tool"] * (turns - 1), _swe_schemas() if calling else None


def _swe_output(rng: random.Random, lengths: _Lengths, repo: _Repo, calling: bool, final: bool) -> Message:
    """Reasoning plus one command; the command takes part of the drawn length and the
    reasoning the rest."""
    size = lengths.output(calling)
    name, args, command = repo.command(rng, round(size * rng.uniform(0.2, 0.6)), final)
    if calling:
        arguments = json.dumps(args, separators=(",", ":"))
        thought = _prose(rng, repo, _SWE_THOUGHTS, max(size - len(name) - len(arguments) - 2, 20))
        return {"role": "assistant", "content": thought, "tool_calls": [_call(rng, name, arguments)]}
    thought = _prose(rng, repo, _SWE_THOUGHTS, max(size - len(command) - 9, 20))
    return {"role": "assistant", "content": f"{thought}\n```\n{command}\n```"}


def _swe_observation(rng: random.Random, lengths: _Lengths, repo: _Repo, last: Message, calling: bool) -> Message:
    text = repo.observation(rng, lengths.new("tool"))
    if not calling:
        return {"role": "user", "content": text}
    call = last["tool_calls"][0]
    return {"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"], "content": text}


# Text material. Everything below is invented for this generator.

ID_ALPHABET = string.ascii_letters + string.digits
GREETING = "Hello, thanks for reaching out. What can I do for you?"
FIRST = ("Ava", "Noah", "Mia", "Liam", "Zoe", "Omar", "Lena", "Ivan", "Sara", "Yuki", "Ravi",
         "Emma", "Lucas", "Nora", "Diego", "Hana", "Tariq", "Greta", "Felix", "Amara")
LAST = ("Garcia", "Novak", "Okafor", "Lindqvist", "Tanaka", "Moreau", "Patel", "Kowalski",
        "Haddad", "Silva", "Nguyen", "Brennan", "Fischer", "Rossi", "Adeyemi", "Holm")
CITIES = ("Lisbon", "Denver", "Osaka", "Leeds", "Austin", "Porto", "Krakow", "Tucson", "Bergen",
          "Toledo", "Halifax", "Nantes", "Dayton", "Graz", "Malmo", "Reno")
STREETS = ("Maple Row", "Harbor Street", "Cedar Lane", "Mill Road", "Quarry Hill", "Station Avenue",
           "Orchard Way", "Lantern Court", "Birch Terrace", "Canal Walk")


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.digits) for _ in range(n))


def _person(rng: random.Random) -> dict:
    return {"first_name": rng.choice(FIRST), "last_name": rng.choice(LAST),
            "birth_date": f"{rng.randint(1950, 2005)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"}


def _date(rng: random.Random) -> str:
    return f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _money(rng: random.Random) -> float:
    return round(rng.uniform(4, 480), 2)


_VALUES: dict[str, Callable[[random.Random], Any]] = {
    "customer_id": lambda r: f"{r.choice(FIRST).lower()}_{r.choice(LAST).lower()}_{_digits(r, 4)}",
    "email": lambda r: f"{r.choice(FIRST).lower()}.{r.choice(LAST).lower()}{_digits(r, 3)}@example.com",
    "order_id": lambda r: f"B-{_digits(r, 6)}",
    "item_id": lambda r: _digits(r, 9),
    "item_ids": lambda r: [_digits(r, 9) for _ in range(r.randint(1, 3))],
    "phone": lambda r: f"555-{_digits(r, 3)}-{_digits(r, 4)}",
    "line_id": lambda r: f"L{_digits(r, 4)}",
    "bill_id": lambda r: f"BL{_digits(r, 6)}",
    "booking_id": lambda r: "".join(r.choice(string.ascii_uppercase + string.digits) for _ in range(6)),
    "train_id": lambda r: f"RX{_digits(r, 3)}",
    "payment_method_id": lambda r: f"{r.choice(('card', 'gift', 'voucher'))}_{_digits(r, 7)}",
    "origin": lambda r: r.choice(CITIES),
    "destination": lambda r: r.choice(CITIES),
    "city": lambda r: r.choice(CITIES),
    "date": _date,
    "placed_on": _date,
    "quantity": lambda r: r.randint(1, 4),
    "gigabytes": lambda r: r.choice((1, 2, 5, 10)),
    "enabled": lambda r: r.random() < 0.5,
    "roaming": lambda r: r.random() < 0.5,
    "fare_class": lambda r: r.choice(("standard", "flex", "first")),
    "seat": lambda r: f"{r.randint(1, 40)}{r.choice('ABCD')}",
    "price": _money,
    "data_used_gb": lambda r: round(r.uniform(0, 30), 2),
    "name": lambda r: {k: v for k, v in _person(r).items() if k != "birth_date"},
    "address": lambda r: {"street": f"{r.randint(1, 999)} {r.choice(STREETS)}", "city": r.choice(CITIES),
                          "postcode": _digits(r, 5), "country": r.choice(("PT", "US", "GB", "DE", "JP"))},
    "plan": lambda r: {"plan_id": f"P{_digits(r, 3)}", "name": r.choice(("Basic", "Plus", "Unlimited")),
                       "monthly_fee": _money(r), "data_gb": r.choice((5, 15, 50))},
    "passenger": _person,
    "item": lambda r: {"item_id": _digits(r, 9), "title": r.choice(_TITLES), "price": _money(r),
                       "quantity": r.randint(1, 3)},
    "event": lambda r: {"date": _date(r), "event": r.choice(("label created", "shipped", "in transit",
                        "out for delivery", "delivered")), "location": r.choice(CITIES)},
    "bill": lambda r: {"bill_id": f"BL{_digits(r, 6)}", "period": f"2024-{r.randint(1, 12):02d}",
                       "amount": _money(r), "status": r.choice(("paid", "overdue", "open"))},
    "leg": lambda r: {"train_id": f"RX{_digits(r, 3)}", "origin": r.choice(CITIES),
                      "destination": r.choice(CITIES), "departs": f"{_date(r)}T{r.randint(5, 22):02d}:15",
                      "platform": r.randint(1, 12)},
    "payment_method": lambda r: {"id": f"card_{_digits(r, 7)}", "kind": r.choice(("credit_card", "gift_card")),
                                 "last_four": _digits(r, 4)},
}
_FREE_TEXT = ("reason", "summary")
_LISTS = {"items": "item", "events": "event", "bills": "bill", "legs": "leg",
          "passengers": "passenger", "payment_methods": "payment_method"}
_TITLES = ("The Salt Road", "Quiet Engines", "A Field Guide to Moss", "Nine Winters", "Paper Harbors",
           "The Clockmaker's Daughter", "Small Gods of the Kitchen", "Tidal Maps", "Learning Rust Slowly")
_SCHEMA_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}


def _value(rng: random.Random, key: str) -> Any:
    if key in _LISTS:
        return [_VALUES[_LISTS[key]](rng) for _ in range(rng.randint(1, 3))]
    return _VALUES[key](rng)


class _Domain:
    """A made-up customer-service business: its tools, records and vocabulary."""

    def __init__(self, company: str, things: tuple, actions: tuple, statuses: tuple,
                 record_keys: tuple, tools: tuple) -> None:
        self.company, self.things, self.actions, self.statuses = company, things, actions, statuses
        self.record_keys, self.tools = record_keys, tools
        self.id_key = record_keys[0]  # the domain's main reference (order, line, booking)

    def slots(self, rng: random.Random) -> dict:
        first, last = rng.choice(FIRST), rng.choice(LAST)
        return {"name": f"{first} {last}", "thing": rng.choice(self.things), "action": rng.choice(self.actions),
                "status": rng.choice(self.statuses), "company": self.company, "date": _date(rng),
                "amount": f"{_money(rng):.2f}", "n": rng.randint(2, 14), "city": rng.choice(CITIES),
                "id": _value(rng, self.id_key), "email": _value(rng, "email"),
                "last_four": _digits(rng, 4), "tier": rng.choice(("silver", "gold", "platinum")),
                "detail": rng.choice(("the customer id", "the booking reference", "the date of birth",
                                      "the email address", "the payment method"))}

    def tool_schemas(self) -> list[dict]:
        return [{"type": "function", "function": {"name": name, "description": doc, "parameters": {
            "type": "object", "properties": {a: self._arg_schema(a) for a in args}, "required": list(args)}}}
            for name, doc, args in self.tools]

    def _arg_schema(self, arg: str) -> dict:
        if arg in _FREE_TEXT:
            return {"type": "string"}
        value = _value(random.Random(arg), arg)
        schema = {"type": _SCHEMA_TYPES[type(value)]}
        if isinstance(value, list):
            schema["items"] = {"type": _SCHEMA_TYPES[type(value[0])]}
        return schema

    def call(self, rng: random.Random, size: int) -> tuple[str, str]:
        """The tool call (name, JSON arguments) whose text length is closest to `size`;
        when no structured call comes close, a free-text call padded up to it."""
        calls = []
        for name, _, args in self.tools:
            if not any(a in _FREE_TEXT for a in args):
                calls += [(name, {a: _value(rng, a) for a in args}) for _ in range(2)]
        name, values = min(calls, key=lambda c: abs(_call_chars(*c) - size))
        free = [(n, args) for n, _, args in self.tools if any(a in _FREE_TEXT for a in args)]
        if size - _call_chars(name, values) > max(15, size // 4) and free:
            name, args = rng.choice(free)
            values = {a: "" if a in _FREE_TEXT else _value(rng, a) for a in args}
            room = max(size - _call_chars(name, values), 8)
            values[next(a for a in args if a in _FREE_TEXT)] = _prose(rng, self, _AGENT_SENTENCES, room)
        return name, json.dumps(values, ensure_ascii=False, separators=(",", ":"))

    def record(self, rng: random.Random, size: int) -> str:
        """A tool result of about `size` characters: a short answer, or a JSON record
        grown with list entries and closed with a free-text note."""
        if size < 48:
            shorts = ["[]", "true", "OK", _value(rng, "customer_id"), f"Error: {rng.choice(self.things)} not found",
                      f"Error: {rng.choice(self.things)} {_digits(rng, 6)} is {rng.choice(self.statuses)}"]
            return min(shorts, key=lambda s: abs(len(s) - size))
        record: dict[str, Any] = {}
        for key in self.record_keys:
            record[key] = rng.choice(self.statuses) if key == "status" else _value(rng, key)
            if len(json.dumps(record)) > size:
                del record[key]
                break
        length = len(json.dumps(record))
        lists = [k for k in record if k in _LISTS]
        while lists:
            key = rng.choice(lists)
            entry = _VALUES[_LISTS[key]](rng)
            if length + len(json.dumps(entry)) + 2 > size:
                break
            record[key].append(entry)
            length += len(json.dumps(entry)) + 2
        room = size - len(json.dumps(record)) - len(', "note": ""')
        if room > 0:
            record["note"] = _prose(rng, self, _AGENT_SENTENCES, room)
        return json.dumps(record, ensure_ascii=False)


_DOMAINS = (
    _Domain("Pagewise Books", ("order", "return", "gift card", "shipping address", "book"),
            ("cancel the order", "start a return", "change the shipping address", "exchange the book",
             "apply the gift card balance"), ("pending", "processed", "shipped", "delivered", "cancelled"),
            ("order_id", "customer_id", "status", "placed_on", "address", "items", "payment_methods", "events"),
            (("find_customer_by_email", "Find a customer's id from their email address.", ("email",)),
             ("get_order", "Get an order with its items, payment and shipping events.", ("order_id",)),
             ("get_customer", "Get a customer's profile, addresses and orders.", ("customer_id",)),
             ("cancel_order", "Cancel a pending order and refund it.", ("order_id", "reason")),
             ("return_items", "Start a return for delivered items.", ("order_id", "item_ids", "payment_method_id")),
             ("update_address", "Change the default shipping address.", ("customer_id", "address")),
             ("escalate_to_human", "Hand the conversation to a human agent.", ("summary",)))),
    _Domain("Brightline Mobile", ("line", "bill", "data plan", "roaming setting", "device"),
            ("add more data", "turn on roaming", "pay the overdue bill", "suspend the line", "change the plan"),
            ("active", "suspended", "overdue", "paid", "pending activation"),
            ("line_id", "customer_id", "name", "phone", "status", "plan", "data_used_gb", "roaming", "bills",
             "payment_methods"),
            (("find_customer_by_phone", "Find a customer from a phone number on their account.", ("phone",)),
             ("get_line", "Get a line's plan, usage and status.", ("line_id",)),
             ("get_customer", "Get a customer's lines, bills and payment methods.", ("customer_id",)),
             ("add_data", "Add extra data to a line for this billing period.", ("line_id", "gigabytes")),
             ("set_roaming", "Turn international roaming on or off.", ("line_id", "enabled")),
             ("pay_bill", "Pay a bill with a stored payment method.", ("bill_id", "payment_method_id")),
             ("escalate_to_human", "Hand the conversation to a human agent.", ("summary",)))),
    _Domain("Northway Rail", ("booking", "ticket", "seat", "passenger list", "connection"),
            ("cancel the booking", "change the seat", "move to a later train", "add a passenger",
             "upgrade to first class"), ("confirmed", "cancelled", "checked in", "pending payment"),
            ("booking_id", "customer_id", "status", "legs", "passengers", "fare_class", "price", "seat",
             "payment_methods"),
            (("search_trains", "List trains between two stations on a date.", ("origin", "destination", "date")),
             ("get_booking", "Get a booking with its legs and passengers.", ("booking_id",)),
             ("get_customer", "Get a customer's profile and bookings.", ("customer_id",)),
             ("book_ticket", "Book a train for passengers.", ("customer_id", "train_id", "fare_class", "passengers")),
             ("cancel_booking", "Cancel a booking and refund what the fare allows.", ("booking_id", "reason")),
             ("change_seat", "Move a passenger to another seat.", ("booking_id", "seat")),
             ("escalate_to_human", "Hand the conversation to a human agent.", ("summary",)))),
)

_AGENT_SENTENCES = (
    "I have looked up the {thing} for {name}.", "The {thing} {id} is currently {status}.",
    "Could you please confirm {detail}?", "Before I {action}, please confirm that you want to go ahead (yes/no).",
    "The total comes to ${amount}, charged to the card ending in {last_four}.",
    "I can {action} for you right away.", "Our policy does not allow me to {action} once the {thing} is {status}.",
    "Thank you for waiting while I checked the details.", "I understand this is frustrating.",
    "Here is what I found:\n- {thing}: {id}\n- status: {status}\n- date: {date}\n- amount: ${amount}\n",
    "A confirmation will be sent to {email}.", "Is there anything else I can help you with?",
    "Your refund of ${amount} goes back to the original payment method within {n} business days.",
)
_FINAL_SENTENCES = (
    "All done: the {thing} {id} is now {status}.", "You will receive a confirmation at {email} shortly.",
    "Thank you for contacting {company}, and have a good day.", "If anything else comes up, just write again.",
) + _AGENT_SENTENCES
_USER_OPENING = (
    "Hi, I need some help with my {thing}.", "Hello! I want to {action}.",
    "Hi there, something is wrong with my {thing} and I'd like it fixed today.",
    "Good morning. I'm {name}, and I have a question about my {thing}.",
)
_USER_SENTENCES = (
    "My name is {name} and my email is {email}.", "I'd like to {action}.", "Yes, please go ahead.",
    "No, I'd rather keep it as it is.", "Can you tell me the status of {id}?", "It was around {date}, I think.",
    "Actually, could you also {action}?", "That sounds fine to me.", "I'm not sure, can you check again?",
    "I moved to {city}, so that should be updated too.", "Please use the card ending in {last_four}.",
    "How long will that take?", "Thanks, that's all I needed.", "Why is it {status}? Nobody told me.",
)
_POLICY_RULES = (
    "- Before you {action}, read the details back to the customer and wait for an explicit yes.",
    "- A {thing} can only be changed while its status is {status}.",
    "- Identify the customer first, by customer id, email or phone number, before looking up any {thing}.",
    "- Never {action} for anyone other than the account holder.",
    "- Refunds go to the original payment method and take {n} business days.",
    "- If a request falls outside this policy, say so and offer escalate_to_human.",
    "- Make one tool call at a time and tell the customer what you are about to do.",
    "- Do not guess {detail}; ask the customer or look it up.",
    "- A change costs ${amount} per {thing} unless the customer holds a {tier} membership.",
    "- Customers with a {tier} membership may {action} free of charge within {n} days.",
)


def _call_chars(name: str, arguments: dict) -> int:
    return len(name) + 1 + len(json.dumps(arguments, ensure_ascii=False, separators=(",", ":")))


def _prose(rng: random.Random, vocabulary: Any, sentences: Sequence[str], size: int,
           opening: Sequence[str] = ()) -> str:
    """Sentences (the first from `opening` if given) filled with the vocabulary's slots
    until `size` characters, then cut."""
    parts: list[str] = []
    length = 0
    while length < size:
        text = rng.choice(opening if opening and not parts else sentences).format_map(vocabulary.slots(rng))
        parts.append(text)
        length += len(text) + 1
    return _fit(" ".join(parts), size)


def _fit(text: str, size: int) -> str:
    """text cut to at most `size` characters, at a word boundary when one is close."""
    if len(text) <= size:
        return text
    cut = text[:size]
    boundary = max(cut.rfind(" "), cut.rfind("\n"))
    return cut[:boundary] if boundary >= size - 12 else cut


def _lines(rng: random.Random, make: Callable[[random.Random], str] | Iterator[str], size: int) -> str:
    """Lines from `make` (a function of rng or an iterator) until `size` characters, cut at
    a line end when one is close."""
    parts: list[str] = []
    length = 0
    while length < size:
        parts.append(next(make) if isinstance(make, Iterator) else make(rng))
        length += len(parts[-1]) + 1
    text = "\n".join(parts)
    if len(text) > size and text.rfind("\n", 0, size) >= size - 80:
        return text[: text.rfind("\n", 0, size)]
    return text[:size]


def _service_prompt(rng: random.Random, domain: _Domain, size: int) -> str:
    head = (f"You are a support agent for {domain.company}. Help the customer within the policy below, "
            "use a tool whenever you need data or want to change something, and either call one tool "
            "or write to the customer in each reply.\n\n<policy>\n")
    return head + _policy(rng, domain, size - len(head) - len("\n</policy>")) + "\n</policy>"


def _policy(rng: random.Random, domain: _Domain, size: int) -> str:
    topics = ("Identifying the customer", "Changes", "Cancellations", "Refunds and fees", "Escalation",
              "Tone", "Payments", "Memberships")

    def section(r: random.Random) -> str:
        rules = [r.choice(_POLICY_RULES).format_map(domain.slots(r)) for _ in range(r.randint(3, 7))]
        return f"\n## {r.choice(topics)}\n\n" + "\n".join(rules)

    head = (f"# {domain.company} support policy\n\nThe current time is {_date(rng)} 09:00 UTC. "
            f"You help customers of {domain.company} with their {', '.join(domain.things)}.")
    return head + _lines(rng, section, size - len(head))


class _Repo:
    """A made-up Python repository: names for paths, functions, commands and outputs."""

    def __init__(self, rng: random.Random) -> None:
        self.pkg = rng.choice(("tidepool", "quillmark", "larkspur", "fennel", "cobalt", "wayfarer"))
        self.modules = rng.sample(_MODULES, 5)
        self.open_file = "n/a"

    def slots(self, rng: random.Random) -> dict:
        return {"path": self.path(rng), "func": _func_name(rng), "noun": rng.choice(_NOUNS),
                "n": rng.randint(3, 900), "error": rng.choice(_ERRORS), "pkg": self.pkg}

    def path(self, rng: random.Random) -> str:
        module = rng.choice(self.modules)
        return rng.choice((f"src/{self.pkg}/{module}.py", f"tests/test_{module}.py"))

    def command(self, rng: random.Random, size: int, final: bool) -> tuple[str, dict, str]:
        """(tool name, arguments, command line) of about `size` characters of call text."""
        if final:
            return "submit", {}, "submit"
        if size > 100 and rng.random() < 0.5:
            start = rng.randint(1, 400)
            code = _lines(rng, _code_lines(rng), size - 60)
            args = {"start_line": start, "end_line": start + rng.randint(0, 6), "replacement_text": code}
            return "edit", args, f"edit {start}:{args['end_line']}\n{code}\nend_of_edit"
        choices = [("open", {"path": self.path(rng), "line_number": rng.randint(1, 500)}),
                   ("search_dir", {"search_term": rng.choice(_NOUNS), "dir": f"src/{self.pkg}"}),
                   ("find_file", {"file_name": f"{rng.choice(self.modules)}.py", "dir": "src"}),
                   ("bash", {"command": rng.choice(_SHELL).format_map(self.slots(rng))}),
                   ("create", {"filename": "reproduce_bug.py"})]
        name, args = min(choices, key=lambda c: abs(len(c[0]) + len(json.dumps(c[1])) - size))
        line = args["command"] if name == "bash" else " ".join([name] + [str(v) for v in args.values()])
        return name, args, line

    def observation(self, rng: random.Random, size: int) -> str:
        """Tool output of about `size` characters: a file window, search hits, a traceback,
        a test run or a listing, with the shell's status footer."""
        kind = rng.choice(("view", "view", "search", "traceback", "tests", "listing"))
        if kind == "view":
            self.open_file = f"/repo/{self.path(rng)}"
        footer = f"\n(Open file: {self.open_file})\n(Current directory: /repo)\nbash-$"
        if size < len(footer) + 60:
            return min(_SHORT_OBSERVATIONS, key=lambda s: abs(len(s) - size))
        if kind == "view":
            first = rng.randint(1, 300)
            numbered = zip(range(first, first + 100_000), _code_lines(rng))
            head = f"[File: {self.open_file} ({first + rng.randint(100, 900)} lines total)]\n"
            body = _lines(rng, lambda r: "{}:{}".format(*next(numbered)), size - len(footer) - len(head))
            return head + body + footer
        head, tail = self._frame(rng, kind)
        body = _lines(rng, lambda r: self._output_line(r, kind), size - len(footer) - len(head) - len(tail))
        return head + body + tail + footer

    def _frame(self, rng: random.Random, kind: str) -> tuple[str, str]:
        term, n = rng.choice(_NOUNS), rng.randint(2, 60)
        if kind == "search":
            return (f'Found {n} matches for "{term}" in /repo/src/{self.pkg}:\n',
                    f'\nEnd of matches for "{term}" in /repo/src/{self.pkg}')
        if kind == "traceback":
            return "Traceback (most recent call last):\n", f"\n{rng.choice(_ERRORS)}: cannot parse {term}: None"
        if kind == "tests":
            return (f"==================== test session starts ====================\nplatform linux -- "
                    f"Python 3.11.9, pytest-8.2.1\nrootdir: /repo\ncollected {n * 7} items\n\n",
                    f"\n========== {n % 5 + 1} failed, {n * 6} passed in {rng.uniform(0.2, 9):.2f}s ==========")
        return f"total {n * 8}\n", ""

    def _output_line(self, rng: random.Random, kind: str) -> str:
        path, func = self.path(rng), _func_name(rng)
        if kind == "search":
            return f"/repo/{path}:{rng.randint(1, 900)}:{_code_line(rng).strip()}"
        if kind == "traceback":
            return f'  File "/repo/{path}", line {rng.randint(1, 900)}, in {func}\n    {_code_line(rng).strip()}'
        if kind == "tests":
            marks = "".join(rng.choice("....F.s") for _ in range(rng.randint(5, 40)))
            return f"{path} {marks} [{rng.randint(1, 100):3d}%]"
        return f"-rw-r--r-- 1 root root {rng.randint(80, 90000):6d} Mar {rng.randint(1, 28):2d} {path}"

    def system_prompt(self, rng: random.Random, size: int) -> str:
        head = ("You are an autonomous software engineer working in a terminal on a Python repository. "
                "Each reply states your reasoning and then exactly one command; wait for its output "
                "before the next one. Interactive programs (editors, REPLs) are not available.\n\n"
                "COMMANDS:\n" + "\n".join(f"{name}: {doc}" for name, doc, _ in _SWE_TOOLS) +
                "\n\nAn example of an earlier session follows.\n")
        return _fit(head + _lines(rng, self._example(rng), size - len(head)), size)

    def _example(self, rng: random.Random) -> Iterator[str]:
        """An endless demonstration: reasoning, a command, and the file window it shows."""
        code = _code_lines(rng)
        while True:
            yield "\n" + _prose(rng, self, _SWE_THOUGHTS, rng.randint(60, 220))
            path, first = self.path(rng), rng.randint(1, 400)
            yield f"```\nopen {path} {first}\n```\n[File: /repo/{path}]"
            yield from (f"{first + i}:{next(code)}" for i in range(rng.randint(5, 30)))

    def issue(self, rng: random.Random, size: int) -> str:
        func, error = _func_name(rng), rng.choice(_ERRORS)
        head = (f"Please fix the following issue in the {self.pkg} repository.\nISSUE:\n{func} raises "
                f"{error} for empty input\n\nCalling `{func}` on an empty {rng.choice(_NOUNS)} fails:\n\n```python\n")
        tail = (f"\n```\n\nINSTRUCTIONS:\nReproduce the bug first, then change the code under src/{self.pkg}, "
                "run the tests and submit when they pass.")
        return _fit(head + _lines(rng, _code_lines(rng), size - len(head) - len(tail)) + tail, size)


def _swe_schemas() -> list[dict]:
    def prop(arg: str) -> dict:
        return {"type": "integer" if arg in ("line_number", "start_line", "end_line") else "string"}

    return [{"type": "function", "function": {"name": name, "description": doc, "parameters": {
        "type": "object", "properties": {a: prop(a) for a in args}, "required": list(args)}}}
        for name, doc, args in _SWE_TOOLS]


_SWE_TOOLS = (
    ("open", "show 100 lines of a file around a line number", ("path", "line_number")),
    ("edit", "replace lines start_line..end_line of the open file with new text", ("start_line", "end_line",
                                                                                    "replacement_text")),
    ("search_dir", "list the files under a folder that contain a term", ("search_term", "dir")),
    ("find_file", "find files by name under a folder", ("file_name", "dir")),
    ("create", "create an empty file and open it", ("filename",)),
    ("bash", "run a shell command and show its output", ("command",)),
    ("submit", "submit the current changes as the solution", ()),
)
_MODULES = ("fields", "schema", "utils", "parser", "io", "cache", "registry", "formats", "decorators",
            "validate", "compat", "timing")
_NOUNS = ("value", "field", "schema", "record", "token", "buffer", "offset", "config", "precision",
          "timestamp", "payload", "context", "options", "result")
_VERBS = ("load", "parse", "serialize", "validate", "resolve", "render", "merge", "compute", "encode", "build")
_ERRORS = ("ValueError", "TypeError", "KeyError", "AttributeError", "IndexError", "AssertionError")
_SHELL = ("python reproduce_bug.py", "python -m pytest tests/test_{noun}.py -x -q", "ls src/{pkg}",
          "grep -rn \"{func}\" src/{pkg}", "git diff", "python -c \"import {pkg}; print({pkg}.__version__)\"")
_SHORT_OBSERVATIONS = ("", "File updated.", "Your command ran successfully and did not produce any output.",
                       "No matches found.", "[File: /repo/reproduce_bug.py (1 lines total)]\n1:")
_SWE_THOUGHTS = (
    "Let's open {path} and see how {func} handles the {noun}.", "The traceback points at {func} in {path}.",
    "Now let's run the reproduction script again to check the fix.",
    "The {error} comes from the {noun} being None when the input is empty.",
    "We should search the package for other callers of {func} before changing it.",
    "The edit looks right; the indentation matches the surrounding block.",
    "Line {n} converts the {noun} before checking it, which is the bug.",
    "Let's write a small script that reproduces the {error}.",
    "All tests pass now, so the change can be submitted.",
)
_STATEMENTS = (
    "    if {a} is None:\n        return {default}", "    {b} = self._{a}s.get({a}, {default})",
    "    for item in {b} or ():\n        {a} = {verb}_{b}(item, {a})",
    "    if not isinstance({a}, {type}):\n        raise {error}(f\"cannot {verb} {a}: {{{a}!r}}\")",
    "    result = [{verb}_{a}(x) for x in {b}]", "    {a} = int(round({a} / {b}))",
    "    # {Verb} before the {b} is checked, so that a missing {a} fails early.",
    "    {b}.update({a}={a}, strict=strict)",
)


def _code_lines(rng: random.Random) -> Iterator[str]:
    """An endless module: imports, then functions with docstrings and small bodies."""
    for module in rng.sample(("json", "math", "typing", "datetime", "decimal", "functools"), 3):
        yield f"import {module}"
    while True:
        a, b, verb = rng.choice(_NOUNS), rng.choice(_NOUNS), rng.choice(_VERBS)
        names = {"a": a, "b": b, "verb": verb, "Verb": verb.title(), "error": rng.choice(_ERRORS),
                 "default": rng.choice(("None", "0", "{}", "()", '""')),
                 "type": rng.choice(("int", "str", "dict", "float"))}
        yield ""
        yield f"def {verb}_{a}({a}, {b}=None, strict=False):"
        yield f'    """{verb.title()} the {a} of a {b}; raise {names["error"]} when strict and it is invalid."""'
        for _ in range(rng.randint(2, 6)):
            yield from rng.choice(_STATEMENTS).format_map(names).split("\n")
        yield f"    return {a}"


def _func_name(rng: random.Random) -> str:
    return f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"


def _code_line(rng: random.Random) -> str:
    """One statement-like line, for search hits and traceback frames."""
    lines = _code_lines(rng)
    return next(line for line in lines if line.startswith("    ") and rng.random() < 0.3).strip()
