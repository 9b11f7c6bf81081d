"""Training prompts for the default draft, written for this project.

The draft learns to imitate the target on the kind of requests the engine serves: chat questions, writing
tasks, coding requests, and raw Python function stubs (HumanEval-style completion). None of these are the
evaluation prompts (bench/inputs.py CHAT_PROMPTS, HumanEval, or train/eval_prompts.py): the measured
acceptance must come from text the draft never saw.
"""

from __future__ import annotations

TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "machine learning",
    "climate change", "the immune system", "volcanoes", "the stock market", "electric cars",
    "the Roman Empire", "DNA", "gravity", "the internet", "renewable energy", "the human brain",
    "earthquakes", "vaccines", "the Great Wall of China", "quantum computing", "inflation",
    "the solar system", "honey bees", "the printing press", "blockchain", "coral reefs",
    "the Industrial Revolution", "sleep", "antibiotics", "the Moon landing", "rainbows", "tides",
    "democracy", "the Amazon rainforest", "coffee", "chess", "the Olympic Games", "bread baking",
    "compound interest", "nuclear fusion", "the Renaissance", "plate tectonics", "jazz music",
    "meditation", "recycling", "the theory of evolution", "operating systems", "compilers",
    "databases", "public key cryptography", "recursion", "sorting algorithms", "neural networks",
    "the TCP/IP protocol", "version control with git", "unit testing", "memory management",
]

FACT_TEMPLATES = [
    "What is {t}?",
    "Explain {t} in simple terms.",
    "Give me a short summary of {t}.",
    "Why is {t} important?",
    "Tell me three interesting facts about {t}.",
    "How would you explain {t} to a ten-year-old?",
]

WRITING_TASKS = [
    "Write a short poem about the ocean.",
    "Write a haiku about autumn leaves.",
    "Write a polite email asking my manager for a day off next Friday.",
    "Write a thank-you note to a friend who helped me move house.",
    "Write a short story about a robot who learns to paint.",
    "Write a product description for a reusable water bottle.",
    "Write a limerick about a cat who loves cheese.",
    "Draft a short speech for a friend's birthday party.",
    "Write a paragraph describing a busy city market in the morning.",
    "Write a motivational message for someone starting a new job.",
    "Write a short dialogue between a teacher and a student about homework.",
    "Write an apology message for missing a meeting.",
    "Write a recipe for a simple tomato pasta.",
    "Write a short review of a fictional restaurant called The Green Fork.",
    "Write a two-sentence horror story.",
    "Write a tweet announcing the launch of a new mobile app.",
    "Write a cover letter opening paragraph for a software engineering job.",
    "Describe a sunset over the mountains in vivid language.",
    "Write a short fairy tale about a brave mouse.",
    "Write instructions for making a paper airplane.",
    "Give me five ideas for a weekend trip with kids.",
    "List ten healthy snacks for work.",
    "Suggest names for a small bakery.",
    "Give me a study plan for learning Spanish in three months.",
    "What are some good habits for staying productive when working from home?",
    "How can I improve my public speaking skills?",
    "What should I pack for a week-long hiking trip?",
    "Give me advice on how to save money on groceries.",
    "How do I start running if I have never exercised before?",
    "What are the pros and cons of living in a big city?",
    "Compare cats and dogs as pets.",
    "What is the difference between weather and climate?",
    "How do airplanes stay in the air?",
    "Why do leaves change color in the fall?",
    "How does a refrigerator keep food cold?",
    "What causes the seasons on Earth?",
    "How many continents are there, and what are they?",
    "Who wrote Pride and Prejudice, and what is it about?",
    "What is the tallest mountain in the world?",
    "What is the boiling point of water at sea level?",
    "Translate 'Good morning, how are you?' into French and Spanish.",
    "What is the square root of 144, and how do you compute it?",
    "Solve for x: 3x + 7 = 22. Show your steps.",
    "What is 15% of 240?",
    "If a train travels 60 miles per hour for 2.5 hours, how far does it go?",
    "Explain the difference between mean, median and mode.",
    "What is a prime number? Give some examples.",
    "Convert 100 degrees Fahrenheit to Celsius.",
]

CODE_TASKS = [
    "reverses a linked list",
    "returns the n-th Fibonacci number",
    "checks whether a number is prime",
    "counts the vowels in a string",
    "merges two sorted lists into one sorted list",
    "finds the largest element in a list",
    "removes duplicates from a list while keeping the order",
    "computes the factorial of a number recursively",
    "sorts a list of dictionaries by a given key",
    "reads a CSV file and returns the rows as dictionaries",
    "converts a temperature from Celsius to Fahrenheit",
    "finds the most common word in a text",
    "implements binary search on a sorted list",
    "flattens a nested list",
    "checks whether two strings are anagrams",
    "computes the greatest common divisor of two integers",
    "returns all permutations of a string",
    "validates an email address with a regular expression",
    "counts the words in a file",
    "implements bubble sort",
    "implements quicksort",
    "transposes a matrix given as a list of lists",
    "checks whether parentheses in a string are balanced",
    "converts a Roman numeral to an integer",
    "returns the sum of the digits of an integer",
    "finds the second largest number in a list",
    "capitalizes the first letter of every word in a sentence",
    "computes the moving average of a list of numbers",
    "groups a list of words by their first letter",
    "returns the intersection of two lists",
    "generates the first n prime numbers",
    "checks whether a year is a leap year",
    "computes the Levenshtein distance between two strings",
    "implements a stack class with push, pop and peek",
    "implements a queue using two stacks",
    "finds all pairs in a list that sum to a target",
    "rotates a list by k positions",
    "converts a decimal number to binary",
    "parses a JSON string and prints its keys",
    "downloads nothing but simulates retrying a function call up to three times",
]

CODE_TEMPLATES = [
    "Write a Python function that {t}.",
    "Write a Python function that {t}, with a docstring and an example.",
    "How do I write a function in Python that {t}?",
    "Write a JavaScript function that {t}.",
]

CODE_QUESTIONS = [
    "What is a Python decorator? Show an example.",
    "Explain list comprehensions in Python with examples.",
    "What is the difference between == and is in Python?",
    "How do I read a file line by line in Python?",
    "What does the yield keyword do in Python?",
    "Explain the difference between a process and a thread.",
    "What is Big O notation?",
    "How do I handle exceptions in Python?",
    "What is the difference between a class and an object?",
    "Explain what a REST API is.",
    "What is a lambda function in Python?",
    "How does garbage collection work in Python?",
    "What is the difference between SQL and NoSQL databases?",
    "How do I create a virtual environment in Python?",
    "Explain inheritance in object-oriented programming.",
    "What are Python's built-in data types?",
    "How do I sort a dictionary by value in Python?",
    "What is the purpose of __init__ in a Python class?",
    "Explain how recursion works with an example.",
    "What is a dictionary in Python and when should I use one?",
]

# Raw completion prompts: a signature and a docstring, continued by the target without a chat template.
CODE_STUBS = [
    ("def is_even(n: int) -> bool:", "Return True if n is even, otherwise False.\n    >>> is_even(4)\n    True"),
    ("def sum_of_squares(numbers: list) -> int:", "Return the sum of the squares of the given numbers.\n    >>> sum_of_squares([1, 2, 3])\n    14"),
    ("def reverse_words(sentence: str) -> str:", "Return the sentence with the order of its words reversed.\n    >>> reverse_words('hello big world')\n    'world big hello'"),
    ("def count_char(s: str, c: str) -> int:", "Count how many times the character c occurs in s.\n    >>> count_char('banana', 'a')\n    3"),
    ("def running_max(values: list) -> list:", "Return a list whose i-th element is the maximum of values[:i + 1].\n    >>> running_max([1, 3, 2, 5])\n    [1, 3, 3, 5]"),
    ("def chunk(items: list, size: int) -> list:", "Split items into consecutive chunks of the given size; the last may be shorter.\n    >>> chunk([1, 2, 3, 4, 5], 2)\n    [[1, 2], [3, 4], [5]]"),
    ("def is_palindrome_number(n: int) -> bool:", "Return True if the decimal digits of n read the same backwards.\n    >>> is_palindrome_number(121)\n    True"),
    ("def dedupe(items: list) -> list:", "Remove duplicates from items, keeping the first occurrence of each.\n    >>> dedupe([3, 1, 3, 2, 1])\n    [3, 1, 2]"),
    ("def word_lengths(text: str) -> dict:", "Map every word in text to its length.\n    >>> word_lengths('a bb ccc')\n    {'a': 1, 'bb': 2, 'ccc': 3}"),
    ("def product(numbers: list) -> int:", "Return the product of all numbers; 1 for an empty list.\n    >>> product([2, 3, 4])\n    24"),
    ("def clamp(x: float, low: float, high: float) -> float:", "Limit x to the interval [low, high].\n    >>> clamp(5, 0, 3)\n    3"),
    ("def digits(n: int) -> list:", "Return the decimal digits of a non-negative integer, most significant first.\n    >>> digits(1203)\n    [1, 2, 0, 3]"),
    ("def triangle_area(a: float, b: float, c: float) -> float:", "Return the area of a triangle with side lengths a, b and c (Heron's formula).\n    >>> triangle_area(3, 4, 5)\n    6.0"),
    ("def longest_word(text: str) -> str:", "Return the longest word in text; the first one on ties.\n    >>> longest_word('a quick brown fox')\n    'quick'"),
    ("def count_upper(s: str) -> int:", "Count the uppercase letters in s.\n    >>> count_upper('Hello World')\n    2"),
    ("def pairwise_diff(values: list) -> list:", "Return the differences between consecutive values.\n    >>> pairwise_diff([1, 4, 9])\n    [3, 5]"),
    ("def to_snake_case(name: str) -> str:", "Convert a CamelCase name to snake_case.\n    >>> to_snake_case('HelloWorld')\n    'hello_world'"),
    ("def mean(values: list) -> float:", "Return the arithmetic mean of a non-empty list of numbers.\n    >>> mean([1, 2, 3, 4])\n    2.5"),
    ("def only_positive(values: list) -> list:", "Return the positive numbers of values in their original order.\n    >>> only_positive([-1, 2, -3, 4])\n    [2, 4]"),
    ("def char_frequency(s: str) -> dict:", "Count the occurrences of every character in s.\n    >>> char_frequency('abca')\n    {'a': 2, 'b': 1, 'c': 1}"),
    ("def nth_triangle(n: int) -> int:", "Return the n-th triangular number 1 + 2 + ... + n.\n    >>> nth_triangle(4)\n    10"),
    ("def all_unique(items: list) -> bool:", "Return True if no element of items appears twice.\n    >>> all_unique([1, 2, 3])\n    True"),
    ("def interleave(a: list, b: list) -> list:", "Interleave two lists; leftover elements go at the end.\n    >>> interleave([1, 3], [2, 4, 6])\n    [1, 2, 3, 4, 6]"),
    ("def caesar_shift(text: str, k: int) -> str:", "Shift every lowercase letter of text by k places in the alphabet, wrapping around.\n    >>> caesar_shift('abz', 1)\n    'bca'"),
    ("def median(values: list) -> float:", "Return the median of a non-empty list of numbers.\n    >>> median([3, 1, 2])\n    2"),
    ("def count_words(text: str) -> int:", "Return the number of whitespace-separated words in text.\n    >>> count_words('one two  three')\n    3"),
    ("def max_subarray_sum(values: list) -> int:", "Return the largest sum of a contiguous non-empty slice of values.\n    >>> max_subarray_sum([-2, 1, -3, 4, -1, 2, 1])\n    6"),
    ("def remove_vowels(s: str) -> str:", "Return s without its vowels.\n    >>> remove_vowels('education')\n    'dctn'"),
    ("def binary_to_int(bits: str) -> int:", "Convert a string of 0s and 1s to an integer.\n    >>> binary_to_int('1011')\n    11"),
    ("def common_prefix(words: list) -> str:", "Return the longest common prefix of all words.\n    >>> common_prefix(['flower', 'flow', 'flight'])\n    'fl'"),
    ("def fizzbuzz(n: int) -> list:", "Return the FizzBuzz sequence from 1 to n as strings.\n    >>> fizzbuzz(5)\n    ['1', '2', 'Fizz', '4', 'Buzz']"),
    ("def sort_by_length(words: list) -> list:", "Sort words by length, keeping the original order among equal lengths.\n    >>> sort_by_length(['ccc', 'a', 'bb'])\n    ['a', 'bb', 'ccc']"),
    ("def index_of_max(values: list) -> int:", "Return the index of the largest value; the first one on ties.\n    >>> index_of_max([1, 5, 3, 5])\n    1"),
    ("def cumulative_sum(values: list) -> list:", "Return the running totals of values.\n    >>> cumulative_sum([1, 2, 3])\n    [1, 3, 6]"),
    ("def is_sorted(values: list) -> bool:", "Return True if values are in non-decreasing order.\n    >>> is_sorted([1, 2, 2, 3])\n    True"),
    ("def vowel_positions(s: str) -> list:", "Return the indices of the vowels in s.\n    >>> vowel_positions('hello')\n    [1, 4]"),
    ("def square_matrix_trace(m: list) -> int:", "Return the sum of the main diagonal of a square matrix.\n    >>> square_matrix_trace([[1, 2], [3, 4]])\n    5"),
    ("def gcd_list(values: list) -> int:", "Return the greatest common divisor of all values.\n    >>> gcd_list([12, 18, 24])\n    6"),
    ("def split_even_odd(values: list) -> tuple:", "Return (evens, odds) from values, each in original order.\n    >>> split_even_odd([1, 2, 3, 4])\n    ([2, 4], [1, 3])"),
    ("def title_case(s: str) -> str:", "Capitalise the first letter of every word in s.\n    >>> title_case('hello world')\n    'Hello World'"),
    ("def count_primes(n: int) -> int:", "Return how many primes are smaller than n.\n    >>> count_primes(10)\n    4"),
    ("def zip_to_dict(keys: list, values: list) -> dict:", "Build a dict from parallel lists of keys and values.\n    >>> zip_to_dict(['a', 'b'], [1, 2])\n    {'a': 1, 'b': 2}"),
    ("def histogram(values: list) -> dict:", "Count how often each value occurs.\n    >>> histogram([1, 1, 2])\n    {1: 2, 2: 1}"),
    ("def string_compress(s: str) -> str:", "Run-length encode s: each run becomes the character followed by its count.\n    >>> string_compress('aaabcc')\n    'a3b1c2'"),
    ("def find_missing(values: list) -> int:", "values holds the numbers 1..n with exactly one missing; return it.\n    >>> find_missing([1, 2, 4, 5])\n    3"),
    ("def hours_to_seconds(hours: float) -> int:", "Convert hours to whole seconds.\n    >>> hours_to_seconds(1.5)\n    5400"),
    ("def rotate_left(values: list, k: int) -> list:", "Rotate values left by k positions.\n    >>> rotate_left([1, 2, 3, 4], 1)\n    [2, 3, 4, 1]"),
    ("def valid_brackets(s: str) -> bool:", "Return True if every bracket in s ((), [] and {}) is properly closed.\n    >>> valid_brackets('([]{})')\n    True"),
]


def chat_prompts() -> list[str]:
    """All chat-style training instructions, in a fixed order."""
    out: list[str] = []
    for i, topic in enumerate(TOPICS):
        # Two templates per topic (rotating) keep the set varied without exploding its size.
        out.append(FACT_TEMPLATES[i % len(FACT_TEMPLATES)].format(t=topic))
        out.append(FACT_TEMPLATES[(i + 3) % len(FACT_TEMPLATES)].format(t=topic))
    out.extend(WRITING_TASKS)
    for i, task in enumerate(CODE_TASKS):
        out.append(CODE_TEMPLATES[i % len(CODE_TEMPLATES)].format(t=task))
        out.append(CODE_TEMPLATES[(i + 1) % len(CODE_TEMPLATES)].format(t=task))
    out.extend(CODE_QUESTIONS)
    return out


def code_stub_prompts() -> list[str]:
    """Raw HumanEval-style completion prompts (signature + docstring)."""
    return [f'{sig}\n    """{doc}\n    """\n' for sig, doc in CODE_STUBS]
