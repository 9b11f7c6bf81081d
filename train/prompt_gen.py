"""Programmatic training prompts for the draft: many more, and more varied, than the hand-written list.

The committed draft overfitted the target's continuations of only 310 hand-written prompts; the prompt
list, not generation time, was the limit. This module multiplies it with

* chat requests: request templates (explain, compare, advise, write, list, ...) crossed with topics, each
  topic with a rotating subset of templates so that the set stays varied without one template dominating;
* coding requests: more programming tasks crossed with request templates;
* raw Python completion stubs (signature + docstring, the HumanEval-style format of prompts.CODE_STUBS)
  extracted with ``ast`` from the Python standard library sources on this machine.

Nothing here may overlap the evaluation prompts (train/eval_prompts.py) or HumanEval (the benchmark set;
not used as a source at all): ``all_prompts`` asserts the former, the stub extractor skips every function
whose name matches an evaluation stub's.
"""

from __future__ import annotations

import ast
import functools
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from eval_prompts import CHAT_EVAL, CODE_EVAL
from prompts import FACT_TEMPLATES, chat_prompts, code_stub_prompts

T = TypeVar("T")

SUBJECTS = [
    # science and nature
    "the speed of light", "magnetism", "static electricity", "the periodic table", "chemical bonds",
    "acids and bases", "the carbon cycle", "cell division", "bacteria and viruses", "the heart",
    "the nervous system", "digestion", "muscles", "the skeleton", "the ozone layer", "hurricanes",
    "tornadoes", "glaciers", "deserts", "rainforests", "ocean currents", "the food chain", "pollination",
    "migration of birds", "dinosaurs", "fossils", "the Big Bang", "galaxies", "stars", "comets", "Mars",
    "Jupiter", "the Sun", "eclipses", "the northern lights", "sound waves", "friction", "energy",
    "atoms", "electric circuits", "batteries", "solar panels", "wind turbines", "nuclear power",
    "genetics", "mutations", "photosynthesis in algae", "soil", "clouds", "lightning", "snowflakes",
    "the rock cycle", "caves", "rivers", "lakes", "islands", "mountains", "whales", "octopuses",
    "ants", "butterflies", "owls", "sharks", "penguins", "elephants", "wolves", "trees", "mushrooms",
    # history and society
    "ancient Egypt", "ancient Greece", "the Vikings", "the Middle Ages", "the Silk Road",
    "the American Revolution", "World War I", "World War II", "the Cold War", "the space race",
    "the invention of the telephone", "the invention of the wheel", "the history of writing",
    "the history of money", "the United Nations", "human rights", "elections", "taxes",
    "supply and demand", "unemployment", "globalisation", "trade", "banks", "credit cards",
    "budgeting", "saving for retirement", "insurance", "the scientific method", "philosophy",
    "ethics", "critical thinking", "the history of medicine", "urbanisation", "public transport",
    "architecture", "the Eiffel Tower", "the pyramids", "Shakespeare", "Mozart", "Leonardo da Vinci",
    "Albert Einstein", "Marie Curie", "Isaac Newton", "Charles Darwin", "impressionist painting",
    "classical music", "rock music", "film making", "photography", "theatre", "poetry", "novels",
    "mythology", "languages", "dialects", "sign language", "education", "homeschooling",
    # everyday life
    "cooking rice", "baking cookies", "making soup", "gardening", "composting", "houseplants",
    "cleaning a kitchen", "doing laundry", "moving house", "renting an apartment", "buying a car",
    "cycling", "swimming", "yoga", "strength training", "running a marathon", "healthy eating",
    "drinking enough water", "stress", "friendship", "teamwork", "time management", "procrastination",
    "job interviews", "negotiating a salary", "starting a small business", "marketing", "customer service",
    "learning a musical instrument", "learning to draw", "travelling on a budget", "camping",
    "first aid", "fire safety", "online privacy", "strong passwords", "phishing emails", "social media",
    "video games", "board games", "reading habits", "keeping a journal", "pets", "dog training",
    "caring for a cat", "bird watching", "volunteering", "public libraries",
    # computing
    "cloud computing", "virtual machines", "containers", "web browsers", "HTML", "CSS", "JavaScript",
    "Python", "APIs", "JSON", "regular expressions", "hash functions", "encryption", "passwords hashing",
    "binary numbers", "floating point numbers", "caching", "load balancing", "distributed systems",
    "concurrency", "deadlocks", "garbage collection", "type systems", "functional programming",
    "object-oriented programming", "design patterns", "code review", "continuous integration",
    "debugging", "logging", "linked lists", "binary trees", "graphs", "dynamic programming",
    "hash tables", "queues and stacks", "search engines", "recommendation systems", "large language models",
    "computer vision", "speech recognition", "robots", "self-driving cars", "3D printing", "the GPU",
    "the CPU", "RAM", "hard drives and SSDs", "Wi-Fi", "Bluetooth", "GPS", "email",
]

EXPLAIN_TEMPLATES = FACT_TEMPLATES + [
    "Write a short paragraph about {t}.",
    "What are the most common misconceptions about {t}?",
    "Can you give me an overview of {t}?",
    "What should a beginner know about {t}?",
    "Describe {t} in one paragraph.",
    "List the key points about {t}.",
    "What are the advantages and disadvantages of {t}?",
    "Write a short blog post introduction about {t}.",
    "Give me five quiz questions about {t} with answers.",
    "Explain {t} using an analogy.",
    "How has {t} changed over time?",
    "Write a haiku about {t}.",
    "Write a short poem about {t}.",
    "Summarise {t} in three bullet points.",
    "I am studying {t}. What are the main ideas I should understand?",
    "Please explain how {t} works.",
]

WRITING_FORMS = [
    "a short poem", "a haiku", "a limerick", "a short story", "a two-paragraph story for children",
    "a formal email", "a friendly text message", "a thank-you note", "a short speech", "a product description",
    "a short review", "a tweet", "a short dialogue", "a diary entry", "a news headline and first paragraph",
    "a riddle", "an advertisement slogan", "a short letter", "a motivational quote with an explanation",
    "a to-do list",
]

WRITING_SUBJECTS = [
    "a rainy afternoon", "a lost dog finding its way home", "the first day of school", "a trip to the beach",
    "a new coffee shop opening", "a birthday surprise", "winter mornings", "a team winning a match",
    "a city at night", "a garden in spring", "a dragon who is afraid of fire", "an old lighthouse keeper",
    "a time traveller", "learning to ride a bike", "a robot chef", "moving to a new country",
    "a forgotten library", "the last day of summer", "a friendly ghost", "a talking tree",
    "a delayed train", "a school science fair", "a mountain hike", "a family dinner", "a music festival",
    "a space station", "a lost umbrella", "a small village bakery", "a snowstorm", "a job promotion",
    "a volunteer day at the park", "a new smartphone", "an online course", "a charity run",
    "a farewell to a colleague", "a wedding anniversary", "a camping trip", "a museum visit",
    "a cat that wants to be a dog", "a broken laptop",
]

ADVICE_ACTIVITIES = [
    "sleep better", "focus while studying", "learn a new language", "keep my house tidy", "eat more vegetables",
    "make friends in a new city", "prepare for an exam", "write a resume", "stop procrastinating",
    "get better at chess", "learn to code", "be more confident", "plan a wedding on a budget",
    "reduce screen time", "start meditating", "train for a 5k run", "cook for a large group",
    "keep plants alive indoors", "organise my email inbox", "read more books", "save for a holiday",
    "improve my handwriting", "prepare for a job interview", "deal with a difficult coworker",
    "teach my dog to sit", "reduce food waste", "write a good essay", "give constructive feedback",
    "remember names", "improve my memory", "wake up earlier", "stay motivated at the gym",
    "learn to touch type", "choose a laptop", "back up my files", "protect my privacy online",
    "make a good first impression", "lead a team meeting", "write clear documentation", "take better photos",
    "learn to swim as an adult", "plan a road trip", "host a dinner party", "start a vegetable garden",
    "reduce my electricity bill", "learn to play the guitar", "negotiate the price of a car",
    "calm down before a presentation", "set goals for the new year", "balance work and family life",
]

ADVICE_TEMPLATES = [
    "How can I {t}?",
    "Give me some tips to {t}.",
    "What is the best way to {t}?",
    "I want to {t}. Where should I start?",
    "Make a step-by-step plan to help me {t}.",
]

COMPARE_PAIRS = [
    ("tea", "coffee"), ("trains", "planes"), ("renting", "buying a home"), ("Python", "Java"),
    ("SQL", "spreadsheets"), ("books", "films"), ("running", "swimming"), ("summer", "winter"),
    ("a laptop", "a desktop computer"), ("electric cars", "petrol cars"), ("cats", "rabbits"),
    ("lists", "dictionaries in Python"), ("TCP", "UDP"), ("RAM", "storage"), ("stocks", "bonds"),
    ("a virus", "a bacterium"), ("weather", "climate"), ("speed", "velocity"), ("mass", "weight"),
    ("a comet", "an asteroid"), ("a simile", "a metaphor"), ("baking", "roasting"),
    ("democracy", "monarchy"), ("introverts", "extroverts"), ("git merge", "git rebase"),
    ("threads", "async code"), ("a compiler", "an interpreter"), ("HTTP", "HTTPS"),
    ("machine learning", "traditional programming"), ("a crocodile", "an alligator"),
]

COMPARE_TEMPLATES = [
    "What is the difference between {a} and {b}?",
    "Compare {a} and {b}.",
    "Which is better, {a} or {b}? Explain briefly.",
]

MATH_TEMPLATES = [
    "What is {a} times {b}?", "What is {a} plus {b}?", "What is {a}% of {b}?",
    "Solve for x: {a}x + {b} = {c}. Show your steps.", "Is {c} a prime number? Explain.",
    "If a car travels {a} kilometres per hour for {b} hours, how far does it go?",
    "A shop sells pens for {a} cents each. How much do {b} pens cost?",
    "What is the average of {a}, {b} and {c}?",
]

MORE_CODE_TASKS = [
    "checks whether a string contains only digits", "returns the longest word in a sentence",
    "computes the power set of a list", "counts how often each character appears in a string",
    "returns the n-th row of Pascal's triangle", "converts a string to title case",
    "finds the median of a list of numbers", "checks whether a list is sorted",
    "merges two dictionaries", "removes all whitespace from a string", "returns the mode of a list",
    "finds the common elements of three lists", "checks whether a number is a perfect square",
    "converts a binary string to an integer", "returns the prime factors of an integer",
    "computes the dot product of two vectors", "multiplies two matrices", "reverses the words in a sentence",
    "finds the first non-repeating character in a string", "checks whether a string is a pangram",
    "returns the k largest elements of a list", "implements a simple LRU cache", "implements insertion sort",
    "implements merge sort", "implements a binary search tree insert", "computes the depth of a binary tree",
    "performs a breadth-first search on a graph", "performs a depth-first search on a graph",
    "finds the shortest path in an unweighted graph", "counts the lines in a text file",
    "writes a list of dictionaries to a CSV file", "parses a date string into a datetime object",
    "returns the number of days between two dates", "generates a random password",
    "shuffles a list without using random.shuffle", "chunks a list into pieces of size n",
    "computes the running total of a list", "checks whether two rectangles overlap",
    "converts snake_case to camelCase", "counts the number of set bits in an integer",
    "finds the missing number in a list from 1 to n", "returns all substrings of a string",
    "checks whether a sudoku row is valid", "computes the area of a circle", "rounds a number to two decimals",
    "finds duplicates in a list", "zips two lists into a dictionary", "sorts a list of tuples by the second item",
    "computes compound interest", "converts kilometres to miles", "returns the last n lines of a file",
    "encodes a string with run-length encoding", "decodes a run-length encoded string",
    "checks whether a string is a valid IPv4 address", "counts the uppercase letters in a string",
    "returns the sum of all even numbers in a list", "finds the longest common prefix of a list of strings",
    "implements a simple calculator for two numbers and an operator", "memoizes a recursive function",
    "times how long a function takes to run",
]

MORE_CODE_TEMPLATES = [
    "Write a Python function that {t}.",
    "Write a Python function that {t}. Include type hints.",
    "Can you show me Python code that {t}?",
    "Write a short Python script that {t}.",
    "Implement a function in Python that {t}, and explain how it works.",
]

# Function names the HumanEval-style evaluation stubs use: never train on a stub with the same name.
EVAL_STUB_NAMES = frozenset(p.split("(", 1)[0].removeprefix("def ").strip() for p in CODE_EVAL)


def _rotating(items: list[str], templates: list[str], per_item: int, key: str = "t") -> list[str]:
    """``per_item`` templates per item, rotating so that every template is used about equally."""
    out = []
    for i, item in enumerate(items):
        for j in range(per_item):
            out.append(templates[(i * per_item + j) % len(templates)].format(**{key: item}))
    return out


def generated_chat_prompts(seed: int = 0) -> list[str]:
    """Chat-style instructions built from templates x topics (deterministic for a seed)."""
    rng = random.Random(seed)
    out = _rotating(SUBJECTS, EXPLAIN_TEMPLATES, 3)
    pairs = [(f, s) for f in WRITING_FORMS for s in WRITING_SUBJECTS]
    rng.shuffle(pairs)
    out += [f"Write {form} about {subject}." for form, subject in pairs[:220]]
    out += _rotating(ADVICE_ACTIVITIES, ADVICE_TEMPLATES, 2)
    out += [t.format(a=a, b=b) for i, (a, b) in enumerate(COMPARE_PAIRS) for t in COMPARE_TEMPLATES[i % 2 : i % 2 + 2]]
    for i in range(40):
        a, b, c = rng.randint(2, 99), rng.randint(2, 60), rng.randint(20, 500)
        out.append(MATH_TEMPLATES[i % len(MATH_TEMPLATES)].format(a=a, b=b, c=c))
    out += _rotating(MORE_CODE_TASKS, MORE_CODE_TEMPLATES, 2)
    return out


def _signature(node: ast.FunctionDef) -> str | None:
    """'def name(args) -> ann' of a public, non-method, non-evaluation function, or None if unsuitable."""
    if node.name.startswith("_") or node.name in EVAL_STUB_NAMES:
        return None
    if node.args.args and node.args.args[0].arg in ("self", "cls"):
        return None
    try:
        sig = f"def {node.name}({ast.unparse(node.args)})"
        if node.returns is not None:
            sig += f" -> {ast.unparse(node.returns)}"
    except (ValueError, AttributeError):
        return None
    return sig if len(sig) <= 120 else None


def _stub_from_function(node: ast.FunctionDef, header: str) -> str | None:
    """'def name(args) -> ann:\\n    \"\"\"first docstring paragraph\\n    \"\"\"\\n', or None if unsuitable."""
    # `header` is unused: first-paragraph stubs have no import lines.
    doc = ast.get_docstring(node)
    sig = _signature(node) if doc else None
    if sig is None:
        return None
    para = doc.strip().split("\n\n", 1)[0]
    if not (20 <= len(para) <= 400) or '"""' in para or "\\" in para:
        return None
    body = "\n    ".join(line.strip() for line in para.splitlines())
    return f'{sig}:\n    """{body}\n    """\n'


def _doc_stub_from_function(node: ast.FunctionDef, header: str) -> str | None:
    """A HumanEval-format stub: import header, signature and the *whole* docstring (examples included), or
    None if unsuitable. Only functions whose docstring has more than one paragraph or a ``>>>`` example."""
    doc = ast.get_docstring(node)
    sig = _signature(node) if doc else None
    if sig is None:
        return None
    doc = doc.strip()
    if not ("\n\n" in doc or ">>>" in doc) or not (60 <= len(doc) <= 1200) or '"""' in doc or "\\" in doc:
        return None
    body = "\n".join(("    " + line).rstrip() for line in doc.splitlines())
    return f'{header}{sig}:\n    """{body.lstrip()}\n    """\n'


@functools.cache
def _stdlib_trees() -> tuple[ast.Module, ...]:
    """The parsed sources of the installed standard library (once per process: both stub kinds use them)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and not {"test", "tests", "idlelib"} & set(p.parts))
    trees = []
    for f in files:
        try:
            trees.append(ast.parse(f.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
    return tuple(trees)


def _import_lines(tree: ast.Module, limit: int = 2) -> str:
    """The module's first ``limit`` top-level import statements, as a HumanEval prompt's header."""
    lines = [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))][:limit]
    return "\n".join(lines) + "\n\n\n" if lines else ""


def _stdlib_stubs(make: Callable[[ast.FunctionDef, str], str | None], limit: int, seed: int) -> list[str]:
    """``make(function, module import header)`` over the public top-level stdlib functions (methods need
    their class to make sense), first stub per name, shuffled, the first ``limit``."""
    stubs: dict[str, str] = {}
    for tree in _stdlib_trees():
        header = _import_lines(tree)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name not in stubs:
                stub = make(node, header)
                if stub is not None:
                    stubs[node.name] = stub
    out = list(stubs.values())
    random.Random(seed).shuffle(out)
    return out[:limit]


def stdlib_stub_prompts(limit: int = 600, seed: int = 0) -> list[str]:
    """Signature + first docstring paragraph of public top-level stdlib functions (HumanEval-style stubs)."""
    return _stdlib_stubs(_stub_from_function, limit, seed)


def stdlib_doc_stub_prompts(limit: int = 700, seed: int = 0) -> list[str]:
    """HumanEval-format stubs (imports, signature, full multi-paragraph docstring with its examples) of
    public top-level stdlib functions: the shape of the benchmark's prompts, which the first-paragraph
    stubs of ``stdlib_stub_prompts`` do not have."""
    return _stdlib_stubs(_doc_stub_from_function, limit, seed)


@dataclass(frozen=True)
class TrainingPrompts:
    chat: list[str]  # instructions (formatted with the chat template by the data stages)
    stubs: list[str]  # raw signature + first-paragraph stubs
    doc_stubs: list[str]  # raw HumanEval-format stubs with the whole docstring (added for draft v6)


def all_prompts(seed: int = 0) -> TrainingPrompts:
    """The training prompts: the hand-written lists first, then the generated ones, deduplicated.

    Raises AssertionError if any prompt equals (or, for stubs, shares a function name with) an evaluation prompt.
    """
    chat = list(dict.fromkeys(chat_prompts() + generated_chat_prompts(seed)))
    stubs = list(dict.fromkeys(code_stub_prompts() + stdlib_stub_prompts(seed=seed)))
    docs = [d for d in dict.fromkeys(stdlib_doc_stub_prompts(seed=seed)) if d not in set(stubs)]
    eval_chat = {p.strip().lower() for p in CHAT_EVAL}
    assert not eval_chat & {p.strip().lower() for p in chat}, "a training chat prompt is an evaluation prompt"
    assert not set(CODE_EVAL) & set(stubs + docs), "a training stub is an evaluation stub"
    names = {m.group(1) for s in stubs + docs for m in [re.search(r"^def (\w+)\(", s, re.MULTILINE)] if m}
    assert not names & EVAL_STUB_NAMES, "a training stub shares a name with an evaluation stub"
    return TrainingPrompts(chat, stubs, docs)


def generation_order(chat: list[T], stubs: list[T], doc_stubs: list[T], seed: int = 0) -> list[T]:
    """The order the data stages generate in, so a record's index identifies its prompt: chat and stubs
    shuffled together (draft v5's data, unchanged), then the shuffled doc stubs. Appending keeps every earlier
    prompt's index, and with it the validation split (every 8th index), what it was."""
    first = list(chat) + list(stubs)
    random.Random(seed).shuffle(first)  # every chunk mixes chat, writing and code
    rest = list(doc_stubs)
    random.Random(seed).shuffle(rest)
    return first + rest


if __name__ == "__main__":
    tp = all_prompts()
    print(f"{len(tp.chat)} chat prompts, {len(tp.stubs)} code stubs, {len(tp.doc_stubs)} full-docstring stubs")
    for p in random.Random(1).sample(tp.chat, 8) + random.Random(1).sample(tp.stubs + tp.doc_stubs, 4):
        print(repr(p))
