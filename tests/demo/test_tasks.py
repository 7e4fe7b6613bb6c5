"""The demo's tasks: seeded generators, disjoint held-out splits, well-formed answers
(checked by sqlite3, json and datetime), and exact-match semantics. No model is loaded."""

import calendar
import datetime
import json
import re
import sqlite3

import pytest

from manylora.demo import tasks as T

N_TRAIN = 2000


@pytest.fixture(scope="module")
def train():
    return {name: T.train_examples(name, N_TRAIN, seed=0) for name in T.TASKS}


@pytest.fixture(scope="module")
def held():
    return {name: T.held_out(name) for name in T.TASKS}


def test_four_tasks_with_adapter_folders():
    assert list(T.TASKS) == ["sql", "json", "sentiment", "date"]
    for name, task in T.TASKS.items():
        assert task.name == name and task.description
        assert T.adapter_dir(name) == T.adapters_root() / task.adapter
        assert T.adapter_dir(name).parent.name == "adapters"
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        T.adapter_dir("nope")
    with pytest.raises(ValueError, match="unknown task"):
        T.held_out("nope")


@pytest.mark.parametrize("name", list(T.TASKS))
def test_generators_are_deterministic_per_seed(name, train):
    assert T.train_examples(name, N_TRAIN, seed=0) == train[name]
    other = T.train_examples(name, N_TRAIN, seed=1)
    assert len(other) == N_TRAIN and other != train[name]
    assert T.held_out(name) == T.held_out(name)
    assert T.held_out(name, 20) == T.held_out(name)[:20]


@pytest.mark.parametrize("name", list(T.TASKS))
def test_held_out_is_disjoint_from_training(name, train, held):
    examples = held[name]
    assert len(examples) == 200
    prompts = [p for p, _ in examples]
    assert len(set(prompts)) == len(prompts)
    assert all(T.is_held_out(p) for p in prompts)
    for seed in (0, 1, 7):
        pool = train[name] if seed == 0 else T.train_examples(name, N_TRAIN, seed=seed)
        assert not set(prompts) & {p for p, _ in pool}
    # the training side is large: far more distinct prompts than one run uses per 100 steps
    assert len({p for p, _ in train[name]}) > 500


def test_chat_messages():
    assert T.chat_messages("Write SQL: x") == [{"role": "user", "content": "Write SQL: x"}]


def _database():
    db = sqlite3.connect(":memory:")
    db.executescript(T.SQL_SCHEMA)
    db.executemany("INSERT INTO users VALUES (?, ?, ?, ?)",
                   [(1, "Alice", 30, "Paris"), (2, "Bob", 50, "Rome"), (3, "Emma", 22, "Paris")])
    db.executemany("INSERT INTO orders VALUES (?, ?, ?, ?)",
                   [(1, 1, 120.0, "shipped"), (2, 1, 15.5, "pending"), (3, 2, 990.0, "refunded")])
    return db


def test_sql_answers_run_against_the_schema(train, held):
    db = _database()
    statements = {a for _, a in train["sql"] + held["sql"]}
    assert len({s.split(" WHERE ")[0] for s in statements}) >= 5   # several templates
    for sql in statements:
        assert sqlite3.complete_statement(sql) and sql.count(";") == 1
        db.execute(sql).fetchall()                                   # parses and runs
    assert db.execute("SELECT name FROM users WHERE city = 'Paris';").fetchall() == \
        [("Alice",), ("Emma",)]


def test_sql_answers_mean_the_question(held):
    for prompt, sql in held["sql"]:
        for number in re.findall(r"\b\d+\b", sql):
            assert re.search(rf"\b{number}\b", prompt), (prompt, sql)
        for quoted in re.findall(r"'([^']*)'", sql):
            assert quoted in prompt, (prompt, sql)


def test_json_answers(train, held):
    for prompt, answer in train["json"][:300] + held["json"]:
        record = json.loads(answer)
        assert list(record) == ["name", "age", "city"]
        assert isinstance(record["age"], int) and isinstance(record["name"], str)
        for value in record.values():
            assert str(value) in prompt
        assert answer == json.dumps(record)


def test_sentiment_answers(train, held):
    labels = [a for _, a in train["sentiment"] + held["sentiment"]]
    assert set(labels) == {"positive", "negative"}
    assert 0.35 < labels.count("positive") / len(labels) < 0.65
    for prompt, label in held["sentiment"]:
        tails = T._GOOD_TAIL if label == "positive" else T._BAD_TAIL
        assert any(prompt.endswith(t) for t in tails)


def _parse_written(text: str) -> datetime.date:
    """An independent reading of the date task's styles."""
    months = {m: i for i, m in enumerate(calendar.month_name) if m}
    months |= {m: i for i, m in enumerate(calendar.month_abbr) if m}
    ordinals = {w: i + 1 for i, w in enumerate(T._ORDINALS)}
    if m := re.fullmatch(r"(\d\d)\.(\d\d)\.(\d{4})", text):
        return datetime.date(int(m[3]), int(m[2]), int(m[1]))
    words = re.sub(r"(?<=\d)(st|nd|rd|th)\b|,|\bthe\b|\bof\b", " ", text).split()
    year = next(int(w) for w in words if len(w) == 4 and w.isdigit())
    month = next(months[w] for w in words if w in months)
    day = next(int(w) if w.isdigit() else ordinals[w] for w in words
               if (w.isdigit() and len(w) <= 2) or w in ordinals)
    return datetime.date(year, month, day)


def test_date_answers_are_iso_and_the_date_meant(train, held):
    styles = set()
    for prompt, answer in train["date"][:500] + held["date"]:
        text = prompt.removeprefix("Convert to an ISO date: ")
        date = datetime.date.fromisoformat(answer)
        assert answer == date.isoformat() and re.fullmatch(r"\d{4}-\d\d-\d\d", answer)
        assert _parse_written(text) == date, prompt
        styles.add(next(s for s in range(7) if T.written_date(date, s) == text))
    assert styles == set(range(7))


def test_exact_match():
    assert T.exact_match("positive", "positive")
    assert T.exact_match("positive", "  positive\n")
    assert T.exact_match(" 2021-03-05 ", "2021-03-05")
    assert not T.exact_match("positive", "Positive")
    assert not T.exact_match("positive", "positive.")
    assert not T.exact_match('{"name": "Ann"}', '{"name":"Ann"}')
    assert not T.exact_match("positive", "The review is positive")
    assert not T.exact_match("positive", "")
