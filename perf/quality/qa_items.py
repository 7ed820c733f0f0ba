"""The multiple-choice set of the quality evaluation, written for this repository: 104 items in four
kinds (arithmetic, capitals, unit conversions, Python output), each with four choices and one
answer. Deterministic: the arithmetic comes from a seeded generator and every choice list is
shuffled by a seeded generator, so ``ITEMS`` is the same on every machine.

Scored greedy through the server as a plain completion after four worked examples (``FEW_SHOT``,
none of them an item), with the choices as a structured-output ``choice`` constraint, so every
answer is exactly one of the four and scoring is an exact comparison. The format was chosen by
measurement against the chat formats (perf/RESULTS.md, "Quality evaluation").
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Item:
    id: str
    kind: str
    question: str
    choices: tuple[str, ...]
    answer: str

    def prompt(self) -> str:
        return f"{FEW_SHOT}Q: {self.question}\nA:"

    def constrained_choices(self) -> list[str]:
        """What the completion may be: a choice after the space that follows "A:" (stripped to score)."""
        return [" " + choice for choice in self.choices]


FEW_SHOT = ("Q: What is 3 plus 4?\nA: 7\n\nQ: What is the capital of Chile?\nA: Santiago\n\n"
            "Q: How many grams are in 3 kilograms?\nA: 3000\n\n"
            "Q: What does this Python code print?\nprint(len([4, 5]))\nA: 2\n\n")


def _arithmetic(rng: random.Random) -> list[Item]:
    items = []
    for index in range(32):
        op = "+-*"[index % 3]
        a, b = rng.randint(2, 60), rng.randint(2, 40 if op != "*" else 12)
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        wrong = {answer + 1, answer - 1, answer + 10, answer - 10, answer + 2} - {answer}
        choices = [answer, *rng.sample(sorted(wrong), 3)]
        word = {"+": "plus", "-": "minus", "*": "times"}[op]
        items.append((f"arith-{index}", "arithmetic", f"What is {a} {word} {b}?", [str(c) for c in choices], str(answer)))
    return items


CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
    ("China", "Beijing"), ("Russia", "Moscow"), ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Australia", "Canberra"),
    ("Brazil", "Brasilia"), ("Argentina", "Buenos Aires"), ("Mexico", "Mexico City"), ("India", "New Delhi"),
    ("Kenya", "Nairobi"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"),
    ("Portugal", "Lisbon"), ("Greece", "Athens"), ("Poland", "Warsaw"), ("Austria", "Vienna"),
    ("Ireland", "Dublin"), ("Turkey", "Ankara"), ("Thailand", "Bangkok"), ("Peru", "Lima"),
    ("South Korea", "Seoul"), ("Vietnam", "Hanoi"), ("Hungary", "Budapest"), ("Denmark", "Copenhagen"),
]

UNITS = [
    ("How many centimetres are in 3 metres?", "300", ["30", "3000", "0.3"]),
    ("How many grams are in 2 kilograms?", "2000", ["200", "20", "20000"]),
    ("How many minutes are in 2 hours?", "120", ["60", "200", "100"]),
    ("How many seconds are in 5 minutes?", "300", ["500", "250", "60"]),
    ("How many millilitres are in 1.5 litres?", "1500", ["150", "15", "15000"]),
    ("How many metres are in 4 kilometres?", "4000", ["400", "40", "40000"]),
    ("How many hours are in 3 days?", "72", ["36", "48", "96"]),
    ("How many days are in 3 weeks?", "21", ["14", "28", "30"]),
    ("How many months are in 4 years?", "48", ["40", "44", "52"]),
    ("How many millimetres are in 7 centimetres?", "70", ["7", "700", "0.7"]),
    ("How many inches are in 2 feet?", "24", ["12", "20", "36"]),
    ("How many feet are in 3 yards?", "9", ["6", "12", "3"]),
    ("How many ounces are in 2 pounds?", "32", ["16", "24", "20"]),
    ("What is 0 degrees Celsius in Fahrenheit?", "32", ["0", "100", "212"]),
    ("What is 100 degrees Celsius in Fahrenheit?", "212", ["100", "180", "232"]),
    ("How many kilobytes are in 3 megabytes (1024 per megabyte)?", "3072", ["3000", "300", "1024"]),
    ("How many centimetres are in 2.5 metres?", "250", ["25", "2500", "205"]),
    ("How many seconds are in 2 hours?", "7200", ["720", "3600", "1200"]),
    ("How many grams are in half a kilogram?", "500", ["50", "250", "5000"]),
    ("How many minutes are in a quarter of an hour?", "15", ["25", "4", "30"]),
    ("How many metres are in 250 centimetres?", "2.5", ["25", "0.25", "250"]),
    ("How many litres are in 3000 millilitres?", "3", ["30", "300", "0.3"]),
]

CODE = [
    ('print(len("hello"))', "5", ["4", "6", "hello"]),
    ("print(2 ** 5)", "32", ["10", "25", "7"]),
    ('print("ab" * 3)', "ababab", ["ab3", "aabb", "abab"]),
    ("print(sorted([3, 1, 2])[0])", "1", ["3", "2", "0"]),
    ("print(10 // 3)", "3", ["3.33", "1", "4"]),
    ("print(10 % 3)", "1", ["3", "0", "10"]),
    ('print("Hello"[1])', "e", ["H", "l", "o"]),
    ("print(list(range(3)))", "[0, 1, 2]", ["[1, 2, 3]", "[0, 1, 2, 3]", "[3]"]),
    ("print(sum([1, 2, 3, 4]))", "10", ["4", "24", "9"]),
    ("print(max(4, 9, 2))", "9", ["4", "2", "15"]),
    ('print(len("a,b,c".split(",")))', "3", ["5", "2", "1"]),
    ("print(len([1, [2, 3]]))", "2", ["3", "1", "4"]),
    ('print(int("7") + 1)', "8", ["71", "7", "6"]),
    ('print("abc".upper())', "ABC", ["abc", "Abc", "aBC"]),
    ("print(bool(0))", "False", ["True", "0", "None"]),
    ("print(3 == 3.0)", "True", ["False", "3", "Error"]),
    ('print("x" in "xyz")', "True", ["False", "x", "1"]),
    ("print(abs(-5))", "5", ["-5", "0", "25"]),
    ("print(round(2.6))", "3", ["2", "2.6", "2.5"]),
    ('print(min("banana"))', "a", ["b", "n", "banana"]),
]


def build_items() -> list[Item]:
    rng = random.Random(20261201)
    raw = _arithmetic(rng)
    all_capitals = [capital for _, capital in CAPITALS]
    for index, (country, capital) in enumerate(CAPITALS):
        wrong = rng.sample([c for c in all_capitals if c != capital], 3)
        raw.append((f"capital-{index}", "capitals", f"What is the capital of {country}?", [capital, *wrong], capital))
    for index, (question, answer, wrong) in enumerate(UNITS):
        raw.append((f"unit-{index}", "units", question, [answer, *wrong], answer))
    for index, (code, answer, wrong) in enumerate(CODE):
        raw.append((f"code-{index}", "code", f"What does this Python code print?\n{code}", [answer, *wrong], answer))
    items = []
    for item_id, kind, question, choices, answer in raw:
        assert answer in choices and len(set(choices)) == 4, item_id
        rng.shuffle(choices)
        items.append(Item(item_id, kind, question, tuple(choices), answer))
    return items


ITEMS = build_items()
