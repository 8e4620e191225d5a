"""Write the demo dataset (data/demo/*.jsonl): extract a person record as strict JSON.

Deterministic (fixed seed, no network). Each example is a chat: a short system message, a
user sentence in one of several phrasings, and the exact answer
`{"name": "Alice Smith", "age": 34, "city": "Lyon"}` (json.dumps key order), so a model's
output can be checked by exact string match. test.jsonl uses first and last names that never
appear in train.jsonl or valid.jsonl. Run: python scripts/make_demo_data.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 1234
SYSTEM = "Reply with JSON only."
PREFIX = "Extract the record: "
SIZES = {"train": 400, "valid": 40, "test": 100}

FIRST = ["Alice", "Bob", "Carla", "David", "Emma", "Frank", "Grace", "Hugo", "Iris", "Jack",
         "Karen", "Leo", "Maria", "Nina", "Oscar", "Paul", "Rosa", "Sam", "Tina", "Victor",
         "Wendy", "Yann", "Zoe", "Anna", "Ben", "Clara", "Dan", "Eva", "Felix", "Hana",
         "Ivan", "Julia", "Lars", "Mia", "Omar", "Pia", "Rita", "Tom", "Uma", "Vera"]
LAST = ["Smith", "Brown", "Garcia", "Miller", "Davis", "Lopez", "Wilson", "Moore", "Taylor",
        "Martin", "Lee", "Walker", "Hall", "Young", "King", "Wright", "Scott", "Green",
        "Baker", "Adams", "Nelson", "Hill", "Campbell", "Mitchell", "Roberts", "Carter",
        "Phillips", "Evans", "Turner", "Torres", "Parker", "Collins", "Edwards", "Stewart",
        "Morris", "Rogers", "Reed", "Cook", "Morgan", "Bell"]
CITIES = ["Lyon", "Paris", "Berlin", "Madrid", "Rome", "Vienna", "Prague", "Oslo", "Dublin",
          "Lisbon", "Boston", "Denver", "Austin", "Seattle", "Chicago", "Toronto", "Sydney",
          "Tokyo", "Seoul", "Cairo", "Lima", "Quito", "Nairobi", "Warsaw", "Athens", "Munich",
          "Milan", "Porto", "Geneva", "Zurich", "Hamburg", "Bristol", "Leeds", "Glasgow",
          "Cardiff", "Bergen", "Turin", "Nice", "Bordeaux", "Seville"]
TEMPLATES = [
    "{name} is {age} years old and lives in {city}.",
    "{name}, {age}, lives in {city}.",
    "{name} ({age}) is from {city}.",
    "Meet {name} from {city}, aged {age}.",
    "In {city} lives {name}, who is {age}.",
    "At {age}, {name} moved to {city}.",
    "{city} resident {name} is {age}.",
    "{name}: {age} years, {city}.",
    "Age {age}, city {city}, name {name}.",
    "{name} lives in {city} and just turned {age}.",
]
HELD_OUT = 8  # first names and last names kept for the test split only


def answer(name: str, age: int, city: str) -> str:
    """The one accepted output, byte for byte."""
    return json.dumps({"name": name, "age": age, "city": city})


def example(rng: random.Random, firsts: list[str], lasts: list[str]) -> tuple[str, dict]:
    name = f"{rng.choice(firsts)} {rng.choice(lasts)}"
    age, city = rng.randint(18, 89), rng.choice(CITIES)
    sentence = rng.choice(TEMPLATES).format(name=name, age=age, city=city)
    record = {"messages": [{"role": "system", "content": SYSTEM},
                           {"role": "user", "content": PREFIX + sentence},
                           {"role": "assistant", "content": answer(name, age, city)}]}
    return name, record


def build() -> dict[str, list[dict]]:
    """The three splits; no user sentence repeats, test names are unseen in train/valid."""
    rng = random.Random(SEED)
    firsts, lasts = FIRST[:], LAST[:]
    rng.shuffle(firsts)
    rng.shuffle(lasts)
    pools = {"train": (firsts[HELD_OUT:], lasts[HELD_OUT:]),
             "valid": (firsts[HELD_OUT:], lasts[HELD_OUT:]),
             "test": (firsts[:HELD_OUT], lasts[:HELD_OUT])}
    seen: set[str] = set()
    splits: dict[str, list[dict]] = {}
    for split, size in SIZES.items():
        rows = []
        while len(rows) < size:
            _, record = example(rng, *pools[split])
            user = record["messages"][1]["content"]
            if user not in seen:
                seen.add(user)
                rows.append(record)
        splits[split] = rows
    return splits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = Path(__file__).resolve().parents[1]
    parser.add_argument("--out", type=Path, default=root / "data" / "demo")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for split, rows in build().items():
        path = args.out / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"{path}: {len(rows)} examples")


if __name__ == "__main__":
    main()
