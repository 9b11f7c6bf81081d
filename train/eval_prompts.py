"""Held-out prompts for measuring the draft (never used in training).

HumanEval-style completion stubs written for this project (raw prompts, no chat template) and chat
instructions (the benchmark's chat prompts plus a few more), rendered with the target's chat template.
"""

from __future__ import annotations

CODE_EVAL = [
    'def has_close_elements(numbers: list, threshold: float) -> bool:\n    """Check if any two numbers in the list are closer to each other than threshold.\n    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)\n    False\n    """\n',
    'def below_zero(operations: list) -> bool:\n    """Given deposit and withdrawal operations on a bank account that starts at zero, return True if the\n    balance ever falls below zero.\n    >>> below_zero([1, 2, -4, 5])\n    True\n    """\n',
    'def string_xor(a: str, b: str) -> str:\n    """Return the bitwise XOR of two strings of 0s and 1s as a string.\n    >>> string_xor(\'010\', \'110\')\n    \'100\'\n    """\n',
    'def longest(strings: list) -> str:\n    """Return the longest string in the list; the first one on ties, None for an empty list.\n    >>> longest([\'a\', \'bb\', \'ccc\'])\n    \'ccc\'\n    """\n',
    'def all_prefixes(string: str) -> list:\n    """Return all prefixes of the string from shortest to longest.\n    >>> all_prefixes(\'abc\')\n    [\'a\', \'ab\', \'abc\']\n    """\n',
    'def count_distinct_characters(string: str) -> int:\n    """Count the distinct characters in the string, ignoring case.\n    >>> count_distinct_characters(\'xyzXYZ\')\n    3\n    """\n',
    'def strlen(string: str) -> int:\n    """Return the length of the given string.\n    >>> strlen(\'abc\')\n    3\n    """\n',
    'def largest_divisor(n: int) -> int:\n    """Return the largest number smaller than n that divides n evenly.\n    >>> largest_divisor(15)\n    5\n    """\n',
    'def flip_case(string: str) -> str:\n    """Flip lowercase characters to uppercase and uppercase to lowercase.\n    >>> flip_case(\'Hello\')\n    \'hELLO\'\n    """\n',
    'def sum_to_n(n: int) -> int:\n    """Return the sum of the integers from 1 to n.\n    >>> sum_to_n(5)\n    15\n    """\n',
]

CHAT_EVAL = [
    "Explain why the sky is blue in a few sentences.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What are the main differences between a list and a tuple in Python?",
    "Give me three tips for writing a good cover letter.",
    "Summarise the plot of Romeo and Juliet.",
    "How does a hash table work? Keep it simple.",
    "Suggest a healthy breakfast that takes less than ten minutes to make.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Describe how a bicycle gear system works.",
    "Write a short note inviting my neighbours to a garden party.",
]
