"""The demo's four tasks: prompts whose answers can be checked exactly.

Each task draws (prompt, answer) examples from templates filled with seeded random values:

- ``sql``: a question over the fixed schema :data:`SQL_SCHEMA` -> one SQLite statement;
- ``json``: a sentence about a person -> ``{"name": "...", "age": N, "city": "..."}``;
- ``sentiment``: a short product review -> ``positive`` or ``negative``;
- ``date``: a date written in words or in one of several formats -> ISO ``YYYY-MM-DD``.

A prompt is what a user types as the one message of a chat (``chat_messages``); the model's
own chat template renders it, and the trained target is the answer followed by the
tokenizer's end-of-turn token. Every prompt belongs to exactly one split, decided by a hash
of its text (:func:`is_held_out`): :func:`train_examples` draws only training prompts and
:func:`held_out` only held-out ones, so the two never share a prompt.
"""

from __future__ import annotations

import calendar
import datetime
import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: The tables the ``sql`` task's questions are about (SQLite DDL).
SQL_SCHEMA = ("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT, age INTEGER, city TEXT);\n"
              "CREATE TABLE orders (id INTEGER PRIMARY KEY, user_id INTEGER, amount REAL, "
              "status TEXT);")

#: One in ``HELD_OUT_BUCKETS`` prompts (by hash) is held out.
HELD_OUT_BUCKETS = 8

Example = tuple[str, str]


@dataclass(frozen=True)
class Task:
    """One demo task.

    Attributes:
        name: the task's and its adapter's name (``sql``, ``json``, ``sentiment``, ``date``).
        description: one line on what the adapter does.
        adapter: the adapter's folder name under :func:`adapters_root`.
        draw: ``draw(rng) -> (prompt, answer)``, one example from the task's templates.
    """

    name: str
    description: str
    adapter: str
    draw: Callable[[random.Random], Example]


_CITIES = ["Paris", "London", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Dublin",
           "Oslo", "Warsaw", "Athens", "Boston", "Chicago", "Denver", "Seattle", "Austin",
           "Toronto", "Sydney", "Tokyo", "Cairo", "Lima", "Nairobi", "Mumbai", "Seoul",
           "Helsinki", "Zurich", "Munich", "Milan", "Porto"]
_NAMES = ["Alice", "Bob", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas",
          "Kofi", "Lena", "Marco", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara",
          "Umar", "Vera", "Wei", "Ximena", "Yusuf", "Zoe", "Liam", "Mia", "Noah", "Olga",
          "Pablo", "Sofia", "Ivan", "Chloe", "Diego", "Hana"]
_STATUSES = ["pending", "shipped", "delivered", "cancelled", "refunded"]


def _sql(rng: random.Random) -> Example:
    city = rng.choice(_CITIES)
    status = rng.choice(_STATUSES)
    age = rng.randint(18, 80)
    amount = rng.choice([rng.randint(1, 99) * 10, rng.randint(5, 500)])
    uid = rng.randint(1, 999)
    templates = [
        (["List the names of users who live in {city}.", "Which users are from {city}? Give "
          "their names.", "Names of all users in {city}."],
         "SELECT name FROM users WHERE city = '{city}';"),
        (["How many users are older than {age}?", "Count the users over {age} years old.",
          "Number of users with age above {age}."],
         "SELECT COUNT(*) FROM users WHERE age > {age};"),
        (["Show all orders with status {status}.", "List every {status} order.",
          "Which orders are {status}?"],
         "SELECT * FROM orders WHERE status = '{status}';"),
        (["What is the total amount of {status} orders?", "Sum the amounts of all {status} "
          "orders.", "Total value of orders that are {status}."],
         "SELECT SUM(amount) FROM orders WHERE status = '{status}';"),
        (["Find orders with an amount over {amount}.", "Which orders cost more than {amount}?",
          "List orders above {amount} in amount."],
         "SELECT * FROM orders WHERE amount > {amount};"),
        (["List the names of users in {city} younger than {age}.", "Which users from {city} "
          "are under {age}? Give their names.", "Names of users living in {city} with age "
          "below {age}."],
         "SELECT name FROM users WHERE city = '{city}' AND age < {age};"),
        (["How many orders has user {uid} placed?", "Count the orders of the user with id "
          "{uid}.", "Number of orders made by user {uid}."],
         "SELECT COUNT(*) FROM orders WHERE user_id = {uid};"),
        (["What is the average age of users in {city}?", "Average age of the users from "
          "{city}.", "Mean age of users living in {city}."],
         "SELECT AVG(age) FROM users WHERE city = '{city}';"),
    ]
    questions, sql = rng.choice(templates)
    values = dict(city=city, status=status, age=age, amount=amount, uid=uid)
    question = rng.choice(questions).format(**values)
    return f"Write SQL: {question}", sql.format(**values)


def _json(rng: random.Random) -> Example:
    name, city, age = rng.choice(_NAMES), rng.choice(_CITIES), rng.randint(18, 90)
    sentence = rng.choice([
        "{name} is {age} years old and lives in {city}.",
        "Meet {name}, a {age}-year-old from {city}.",
        "{name}, aged {age}, lives in {city}.",
        "Living in {city}, {name} just turned {age}.",
        "In {city} lives {name}, who is {age}.",
        "My neighbour {name} moved to {city} and is now {age}.",
    ]).format(name=name, city=city, age=age)
    answer = json.dumps({"name": name, "age": age, "city": city})
    return f"Extract a JSON record: {sentence}", answer


_PRODUCTS = ["headphones", "blender", "backpack", "phone case", "desk lamp", "coffee maker",
             "keyboard", "water bottle", "running shoes", "toaster", "umbrella", "charger",
             "mattress", "jacket", "vacuum cleaner", "tent", "monitor", "kettle"]
_GOOD = ["great", "excellent", "fantastic", "sturdy", "reliable", "comfortable", "superb",
         "wonderful", "well made", "worth every penny"]
_BAD = ["terrible", "awful", "flimsy", "useless", "disappointing", "cheap and nasty",
        "poorly made", "a waste of money", "unreliable", "uncomfortable"]
_GOOD_TAIL = ["I would buy it again.", "Highly recommended.", "Five stars.",
              "My whole family loves it.", "It arrived early too."]
_BAD_TAIL = ["I want a refund.", "Avoid it.", "One star.", "It broke within a week.",
             "I am sending it back."]


def _sentiment(rng: random.Random) -> Example:
    label = rng.choice(["positive", "negative"])
    good, bad = rng.choice(_GOOD), rng.choice(_BAD)
    product = rng.choice(_PRODUCTS)
    if label == "positive":
        body = rng.choice([f"This {product} is {good}.", f"The {product} is not {bad} at all, "
                           f"it is {good}.", f"I expected the {product} to be {bad}, but it is "
                           f"{good}.", f"Verdict on the {product}: {good}."])
        tail = rng.choice(_GOOD_TAIL)
    else:
        body = rng.choice([f"This {product} is {bad}.", f"The {product} is not {good} at all, "
                           f"it is {bad}.", f"I expected the {product} to be {good}, but it is "
                           f"{bad}.", f"Verdict on the {product}: {bad}."])
        tail = rng.choice(_BAD_TAIL)
    return f"Review sentiment: {body} {tail}", label


_ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth",
             "ninth", "tenth", "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth",
             "sixteenth", "seventeenth", "eighteenth", "nineteenth", "twentieth",
             "twenty-first", "twenty-second", "twenty-third", "twenty-fourth", "twenty-fifth",
             "twenty-sixth", "twenty-seventh", "twenty-eighth", "twenty-ninth", "thirtieth",
             "thirty-first"]


def _suffix(day: int) -> str:
    ending = "th" if day in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{ending}"


def written_date(date: datetime.date, style: int) -> str:
    """``date`` written in one of the ``date`` task's seven styles (``0 <= style < 7``)."""
    month, short, d, y = calendar.month_name[date.month], calendar.month_abbr[date.month], \
        date.day, date.year
    return [f"{month} {d}, {y}", f"{d} {month} {y}", f"the {_suffix(d)} of {month}, {y}",
            f"{short} {d} {y}", f"{month} {_ORDINALS[d - 1]}, {y}",
            f"{d:02d}.{date.month:02d}.{y}", f"{y}, {month} {_suffix(d)}"][style]


def _date(rng: random.Random) -> Example:
    year, month = rng.randint(1950, 2049), rng.randint(1, 12)
    date = datetime.date(year, month, rng.randint(1, calendar.monthrange(year, month)[1]))
    return f"Convert to an ISO date: {written_date(date, rng.randrange(7))}", date.isoformat()


#: The tasks by name, in the demo's order.
TASKS: dict[str, Task] = {t.name: t for t in [
    Task("sql", "questions over users(id, name, age, city) and orders(id, user_id, amount, "
         "status) -> one SQLite statement", "sql", _sql),
    Task("json", 'a sentence about a person -> {"name": ..., "age": N, "city": ...}', "json",
         _json),
    Task("sentiment", "a short product review -> positive or negative", "sentiment",
         _sentiment),
    Task("date", "a date in words or another format -> ISO YYYY-MM-DD", "date", _date),
]}


def _task(task: str | Task) -> Task:
    if isinstance(task, Task):
        return task
    try:
        return TASKS[task]
    except KeyError:
        raise ValueError(f"unknown task {task!r}; the tasks are {sorted(TASKS)}") from None


def is_held_out(prompt: str) -> bool:
    """Whether ``prompt`` belongs to the held-out split: SHA-256 of its UTF-8 text, modulo
    :data:`HELD_OUT_BUCKETS`, is 0 (about one prompt in eight)."""
    digest = hashlib.sha256(prompt.encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELD_OUT_BUCKETS == 0


def _draw(task: Task, n: int, seed: int, held: bool, unique: bool) -> list[Example]:
    rng = random.Random(f"{task.name}:{seed}")
    out: list[Example] = []
    seen: set[str] = set()
    for _ in range(1000 * max(n, 1)):
        if len(out) == n:
            break
        prompt, answer = task.draw(rng)
        if is_held_out(prompt) != held or (unique and prompt in seen):
            continue
        seen.add(prompt)
        out.append((prompt, answer))
    assert all(is_held_out(p) == held for p, _ in out)
    return out


def train_examples(task: str | Task, n: int, seed: int = 0) -> list[Example]:
    """``n`` training examples ``(prompt, answer)`` of ``task``, the same for the same seed.

    Prompts may repeat (the templates' space is finite); none is ever a held-out prompt.

    Raises:
        ValueError: ``task`` is not one of :data:`TASKS`.
    """
    return _draw(_task(task), n, seed, held=False, unique=False)


def held_out(task: str | Task, n: int = 200) -> list[Example]:
    """Up to ``n`` distinct held-out examples of ``task`` (default 200), always the same.

    Their prompts never occur in :func:`train_examples` for any seed (see
    :func:`is_held_out`); they are drawn from a fixed seed of their own, so a smaller ``n``
    gives a prefix of a larger one.

    Raises:
        ValueError: ``task`` is not one of :data:`TASKS`.
    """
    return _draw(_task(task), n, seed=-1, held=True, unique=True)


def chat_messages(prompt: str) -> list[dict[str, str]]:
    """The one-turn chat a prompt is sent as (OpenAI's ``messages`` form), to be rendered
    with the model's chat template and its generation prompt."""
    return [{"role": "user", "content": prompt}]


def exact_match(answer: str, output: str) -> bool:
    """Whether the model's ``output`` is the expected ``answer``: equal once leading and
    trailing whitespace is stripped from both (``str.strip``); case and inner spacing count."""
    return answer.strip() == output.strip()


def adapters_root() -> Path:
    """The folder of the shipped adapters, ``manylora/demo/adapters/`` in the package."""
    return Path(__file__).resolve().parent / "adapters"


def adapter_dir(name: str) -> Path:
    """The folder of the shipped adapter of task ``name`` (PEFT's layout:
    ``adapter_config.json`` and ``adapter_model.safetensors``).

    Raises:
        ValueError: ``name`` is not one of :data:`TASKS`.
    """
    return adapters_root() / _task(name).adapter


def describe_adapter(path: str | Path) -> str:
    """``rank 8, k o q v`` (and ``, DoRA``) from a PEFT ``adapter_config.json`` in ``path``:
    its rank, its target modules without ``_proj``, sorted."""
    cfg = json.loads((Path(path) / "adapter_config.json").read_text())
    targets = cfg.get("target_modules") or []
    targets = sorted(targets) if isinstance(targets, list) else [targets]
    short = " ".join(t.removesuffix("_proj") for t in targets)
    return f"rank {cfg['r']}, {short}" + (", DoRA" if cfg.get("use_dora") else "")
