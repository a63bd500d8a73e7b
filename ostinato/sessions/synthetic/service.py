"""The customer-service family (tau2 and tau-bench shape): made-up businesses with their
tools, JSON records, policies and customer and agent sentences."""

from __future__ import annotations

import json
import random
import string
from typing import Any, Callable

from ostinato.sessions.turns import Message
from ostinato.sessions.synthetic.common import _Built, _Lengths, _call, _lines, _prose


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


# Text material. Everything below is invented for this generator.

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
