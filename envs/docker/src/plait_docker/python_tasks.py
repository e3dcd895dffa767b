"""plait's own small Python task set (`code.python`), in HumanEval's shape.

Short, self-contained functions with several hidden tests each, so that partial credit is
meaningful. Written for plait; each canonical solution passes its tests (checked in the test suite,
through the sandbox).
"""

from __future__ import annotations

TASKS: list[dict[str, str]] = [
    {
        "task_id": "plait/0",
        "entry_point": "running_sum",
        "prompt": (
            "def running_sum(numbers: list[int]) -> list[int]:\n"
            '    """Return the list of prefix sums of `numbers`.\n'
            "    >>> running_sum([1, 2, 3])\n"
            "    [1, 3, 6]\n"
            '    """\n'
        ),
        "canonical_solution": (
            "    total, out = 0, []\n"
            "    for n in numbers:\n"
            "        total += n\n"
            "        out.append(total)\n"
            "    return out\n"
        ),
        "test": (
            "def check(candidate):\n"
            "    assert candidate([]) == []\n"
            "    assert candidate([5]) == [5]\n"
            "    assert candidate([1, 2, 3]) == [1, 3, 6]\n"
            "    assert candidate([3, -3, 3]) == [3, 0, 3]\n"
            "    assert candidate([0, 0, 7, 1]) == [0, 0, 7, 8]\n"
        ),
    },
    {
        "task_id": "plait/1",
        "entry_point": "is_palindrome",
        "prompt": (
            "def is_palindrome(text: str) -> bool:\n"
            '    """True if `text` reads the same backwards, ignoring case and every '
            "character that is not a\n"
            "    letter or a digit.\n"
            '    >>> is_palindrome("A man, a plan, a canal: Panama")\n'
            "    True\n"
            '    """\n'
        ),
        "canonical_solution": (
            "    kept = [c.lower() for c in text if c.isalnum()]\n    return kept == kept[::-1]\n"
        ),
        "test": (
            "def check(candidate):\n"
            "    assert candidate('') is True\n"
            "    assert candidate('A man, a plan, a canal: Panama') is True\n"
            "    assert candidate('race a car') is False\n"
            "    assert candidate('No lemon, no melon') is True\n"
            "    assert candidate('ab') is False\n"
            "    assert candidate('12321') is True\n"
        ),
    },
    {
        "task_id": "plait/2",
        "entry_point": "word_counts",
        "prompt": (
            "def word_counts(text: str) -> dict[str, int]:\n"
            '    """Count the words of `text` (split on whitespace, lower-cased).\n'
            '    >>> word_counts("a b A")\n'
            "    {'a': 2, 'b': 1}\n"
            '    """\n'
        ),
        "canonical_solution": (
            "    counts: dict[str, int] = {}\n"
            "    for word in text.lower().split():\n"
            "        counts[word] = counts.get(word, 0) + 1\n"
            "    return counts\n"
        ),
        "test": (
            "def check(candidate):\n"
            "    assert candidate('') == {}\n"
            "    assert candidate('a b A') == {'a': 2, 'b': 1}\n"
            "    assert candidate('  x\\ty\\nx  ') == {'x': 2, 'y': 1}\n"
            "    assert candidate('The the THE') == {'the': 3}\n"
        ),
    },
    {
        "task_id": "plait/3",
        "entry_point": "flatten",
        "prompt": (
            "def flatten(nested: list) -> list:\n"
            '    """Flatten arbitrarily nested lists into one list, keeping the order.\n'
            "    >>> flatten([1, [2, [3, 4]], 5])\n"
            "    [1, 2, 3, 4, 5]\n"
            '    """\n'
        ),
        "canonical_solution": (
            "    out = []\n"
            "    for item in nested:\n"
            "        if isinstance(item, list):\n"
            "            out.extend(flatten(item))\n"
            "        else:\n"
            "            out.append(item)\n"
            "    return out\n"
        ),
        "test": (
            "def check(candidate):\n"
            "    assert candidate([]) == []\n"
            "    assert candidate([1, [2, [3, 4]], 5]) == [1, 2, 3, 4, 5]\n"
            "    assert candidate([[[]]]) == []\n"
            "    assert candidate([['a'], 'b', [['c']]]) == ['a', 'b', 'c']\n"
            "    assert candidate([1, 2, 3]) == [1, 2, 3]\n"
        ),
    },
    {
        "task_id": "plait/4",
        "entry_point": "gcd",
        "prompt": (
            "def gcd(a: int, b: int) -> int:\n"
            '    """The greatest common divisor of two non-negative integers (gcd(0, 0) == 0).\n'
            "    >>> gcd(12, 18)\n"
            "    6\n"
            '    """\n'
        ),
        "canonical_solution": ("    while b:\n        a, b = b, a % b\n    return a\n"),
        "test": (
            "def check(candidate):\n"
            "    assert candidate(12, 18) == 6\n"
            "    assert candidate(0, 5) == 5\n"
            "    assert candidate(5, 0) == 5\n"
            "    assert candidate(0, 0) == 0\n"
            "    assert candidate(17, 13) == 1\n"
            "    assert candidate(2**20, 2**12 * 3) == 2**12\n"
        ),
    },
    {
        "task_id": "plait/5",
        "entry_point": "is_prime",
        "prompt": (
            "def is_prime(n: int) -> bool:\n"
            '    """True if `n` is a prime number.\n'
            "    >>> is_prime(7)\n"
            "    True\n"
            '    """\n'
        ),
        "canonical_solution": (
            "    if n < 2:\n"
            "        return False\n"
            "    i = 2\n"
            "    while i * i <= n:\n"
            "        if n % i == 0:\n"
            "            return False\n"
            "        i += 1\n"
            "    return True\n"
        ),
        "test": (
            "def check(candidate):\n"
            "    assert candidate(-7) is False\n"
            "    assert candidate(0) is False\n"
            "    assert candidate(1) is False\n"
            "    assert candidate(2) is True\n"
            "    assert candidate(9) is False\n"
            "    assert candidate(97) is True\n"
            "    assert [n for n in range(30) if candidate(n)] == [2, 3, 5, 7, 11, 13, 17, "
            "19, 23, 29]\n"
        ),
    },
    {
        "task_id": "plait/6",
        "entry_point": "fizzbuzz",
        "prompt": (
            "def fizzbuzz(n: int) -> list[str]:\n"
            '    """The FizzBuzz sequence from 1 to n: "Fizz" for multiples of 3, "Buzz" '
            "for multiples of 5,\n"
            '    "FizzBuzz" for multiples of both, the number as a string otherwise.\n'
            "    >>> fizzbuzz(5)\n"
            "    ['1', '2', 'Fizz', '4', 'Buzz']\n"
            '    """\n'
        ),
        "canonical_solution": (
            "    out = []\n"
            "    for i in range(1, n + 1):\n"
            "        s = ('Fizz' if i % 3 == 0 else '') + ('Buzz' if i % 5 == 0 else '')\n"
            "        out.append(s or str(i))\n"
            "    return out\n"
        ),
        "test": (
            "def check(candidate):\n"
            "    assert candidate(0) == []\n"
            "    assert candidate(5) == ['1', '2', 'Fizz', '4', 'Buzz']\n"
            "    assert candidate(15)[-1] == 'FizzBuzz'\n"
            "    assert candidate(15).count('Fizz') == 4\n"
        ),
    },
    {
        "task_id": "plait/7",
        "entry_point": "rle_encode",
        "prompt": (
            "def rle_encode(text: str) -> str:\n"
            '    """Run-length encode `text`: each run of a character becomes the count '
            "followed by the character.\n"
            '    >>> rle_encode("aaabcc")\n'
            "    '3a1b2c'\n"
            '    """\n'
        ),
        "canonical_solution": (
            "    out = []\n"
            "    i = 0\n"
            "    while i < len(text):\n"
            "        j = i\n"
            "        while j < len(text) and text[j] == text[i]:\n"
            "            j += 1\n"
            "        out.append(f'{j - i}{text[i]}')\n"
            "        i = j\n"
            "    return ''.join(out)\n"
        ),
        "test": (
            "def check(candidate):\n"
            "    assert candidate('') == ''\n"
            "    assert candidate('a') == '1a'\n"
            "    assert candidate('aaabcc') == '3a1b2c'\n"
            "    assert candidate('abab') == '1a1b1a1b'\n"
            "    assert candidate('z' * 12) == '12z'\n"
        ),
    },
    {
        "task_id": "plait/8",
        "entry_point": "balanced_brackets",
        "prompt": (
            "def balanced_brackets(text: str) -> bool:\n"
            '    """True if the brackets (), [] and {} in `text` are balanced and properly '
            "nested; other characters\n"
            "    are ignored.\n"
            '    >>> balanced_brackets("f(a[1]) {}")\n'
            "    True\n"
            '    """\n'
        ),
        "canonical_solution": (
            "    pairs = {')': '(', ']': '[', '}': '{'}\n"
            "    stack = []\n"
            "    for c in text:\n"
            "        if c in '([{':\n"
            "            stack.append(c)\n"
            "        elif c in pairs:\n"
            "            if not stack or stack.pop() != pairs[c]:\n"
            "                return False\n"
            "    return not stack\n"
        ),
        "test": (
            "def check(candidate):\n"
            "    assert candidate('') is True\n"
            "    assert candidate('f(a[1]) {}') is True\n"
            "    assert candidate('(]') is False\n"
            "    assert candidate('([)]') is False\n"
            "    assert candidate('((') is False\n"
            "    assert candidate('{[()()]}') is True\n"
            "    assert candidate(')(') is False\n"
        ),
    },
    {
        "task_id": "plait/9",
        "entry_point": "binary_search",
        "prompt": (
            "def binary_search(items: list[int], target: int) -> int:\n"
            '    """The index of `target` in the sorted list `items`, or -1 if it is absent.\n'
            "    >>> binary_search([1, 3, 5, 7], 5)\n"
            "    2\n"
            '    """\n'
        ),
        "canonical_solution": (
            "    lo, hi = 0, len(items) - 1\n"
            "    while lo <= hi:\n"
            "        mid = (lo + hi) // 2\n"
            "        if items[mid] == target:\n"
            "            return mid\n"
            "        if items[mid] < target:\n"
            "            lo = mid + 1\n"
            "        else:\n"
            "            hi = mid - 1\n"
            "    return -1\n"
        ),
        "test": (
            "def check(candidate):\n"
            "    assert candidate([], 3) == -1\n"
            "    assert candidate([1, 3, 5, 7], 5) == 2\n"
            "    assert candidate([1, 3, 5, 7], 1) == 0\n"
            "    assert candidate([1, 3, 5, 7], 7) == 3\n"
            "    assert candidate([1, 3, 5, 7], 4) == -1\n"
            "    data = list(range(0, 2000, 2))\n"
            "    assert all(candidate(data, v) == v // 2 for v in data)\n"
        ),
    },
    {
        "task_id": "plait/10",
        "entry_point": "transpose",
        "prompt": (
            "def transpose(matrix: list[list[int]]) -> list[list[int]]:\n"
            '    """The transpose of a rectangular matrix given as a list of rows.\n'
            "    >>> transpose([[1, 2, 3], [4, 5, 6]])\n"
            "    [[1, 4], [2, 5], [3, 6]]\n"
            '    """\n'
        ),
        "canonical_solution": "    return [list(row) for row in zip(*matrix)]\n",
        "test": (
            "def check(candidate):\n"
            "    assert candidate([]) == []\n"
            "    assert candidate([[1]]) == [[1]]\n"
            "    assert candidate([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]\n"
            "    assert candidate([[1], [2], [3]]) == [[1, 2, 3]]\n"
        ),
    },
    {
        "task_id": "plait/11",
        "entry_point": "roman_to_int",
        "prompt": (
            "def roman_to_int(numeral: str) -> int:\n"
            '    """The value of a Roman numeral (I, V, X, L, C, D, M with subtractive notation).\n'
            '    >>> roman_to_int("XIV")\n'
            "    14\n"
            '    """\n'
        ),
        "canonical_solution": (
            "    values = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, 'M': 1000}\n"
            "    total = 0\n"
            "    for i, c in enumerate(numeral):\n"
            "        v = values[c]\n"
            "        if i + 1 < len(numeral) and values[numeral[i + 1]] > v:\n"
            "            total -= v\n"
            "        else:\n"
            "            total += v\n"
            "    return total\n"
        ),
        "test": (
            "def check(candidate):\n"
            "    assert candidate('I') == 1\n"
            "    assert candidate('IV') == 4\n"
            "    assert candidate('IX') == 9\n"
            "    assert candidate('XIV') == 14\n"
            "    assert candidate('MCMXCIV') == 1994\n"
            "    assert candidate('MMXXVI') == 2026\n"
        ),
    },
    {
        "task_id": "plait/12",
        "entry_point": "second_largest",
        "prompt": (
            "def second_largest(numbers: list[int]) -> int | None:\n"
            '    """The second largest distinct value in `numbers`, or None if there is none.\n'
            "    >>> second_largest([3, 1, 3, 2])\n"
            "    2\n"
            '    """\n'
        ),
        "canonical_solution": (
            "    distinct = sorted(set(numbers))\n"
            "    return distinct[-2] if len(distinct) >= 2 else None\n"
        ),
        "test": (
            "def check(candidate):\n"
            "    assert candidate([]) is None\n"
            "    assert candidate([4]) is None\n"
            "    assert candidate([4, 4]) is None\n"
            "    assert candidate([3, 1, 3, 2]) == 2\n"
            "    assert candidate([-5, -1, -3]) == -3\n"
        ),
    },
    {
        "task_id": "plait/13",
        "entry_point": "merge_intervals",
        "prompt": (
            "def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:\n"
            '    """Merge overlapping or touching closed intervals; return them sorted by start.\n'
            "    >>> merge_intervals([(5, 6), (1, 3), (2, 4)])\n"
            "    [(1, 4), (5, 6)]\n"
            '    """\n'
        ),
        "canonical_solution": (
            "    merged: list[tuple[int, int]] = []\n"
            "    for start, end in sorted(intervals):\n"
            "        if merged and start <= merged[-1][1]:\n"
            "            merged[-1] = (merged[-1][0], max(merged[-1][1], end))\n"
            "        else:\n"
            "            merged.append((start, end))\n"
            "    return merged\n"
        ),
        "test": (
            "def check(candidate):\n"
            "    assert candidate([]) == []\n"
            "    assert candidate([(5, 6), (1, 3), (2, 4)]) == [(1, 4), (5, 6)]\n"
            "    assert candidate([(1, 2), (2, 3)]) == [(1, 3)]\n"
            "    assert candidate([(1, 10), (2, 3)]) == [(1, 10)]\n"
            "    assert candidate([(3, 4), (0, 1)]) == [(0, 1), (3, 4)]\n"
        ),
    },
    {
        "task_id": "plait/14",
        "entry_point": "caesar",
        "prompt": (
            "def caesar(text: str, shift: int) -> str:\n"
            '    """Shift every ASCII letter of `text` by `shift` places in the alphabet, '
            "keeping its case;\n"
            "    other characters are unchanged.\n"
            '    >>> caesar("Abc, xyz!", 2)\n'
            "    'Cde, zab!'\n"
            '    """\n'
        ),
        "canonical_solution": (
            "    out = []\n"
            "    for c in text:\n"
            "        if 'a' <= c <= 'z':\n"
            "            out.append(chr((ord(c) - 97 + shift) % 26 + 97))\n"
            "        elif 'A' <= c <= 'Z':\n"
            "            out.append(chr((ord(c) - 65 + shift) % 26 + 65))\n"
            "        else:\n"
            "            out.append(c)\n"
            "    return ''.join(out)\n"
        ),
        "test": (
            "def check(candidate):\n"
            "    assert candidate('', 3) == ''\n"
            "    assert candidate('Abc, xyz!', 2) == 'Cde, zab!'\n"
            "    assert candidate('abc', -1) == 'zab'\n"
            "    assert candidate('Hello', 26) == 'Hello'\n"
            "    assert candidate(candidate('Round Trip', 7), -7) == 'Round Trip'\n"
        ),
    },
    {
        "task_id": "plait/15",
        "entry_point": "digits_sum",
        "prompt": (
            "def digits_sum(n: int) -> int:\n"
            '    """The sum of the decimal digits of the integer `n` (its sign is ignored).\n'
            "    >>> digits_sum(-123)\n"
            "    6\n"
            '    """\n'
        ),
        "canonical_solution": "    return sum(int(d) for d in str(abs(n)))\n",
        "test": (
            "def check(candidate):\n"
            "    assert candidate(0) == 0\n"
            "    assert candidate(7) == 7\n"
            "    assert candidate(-123) == 6\n"
            "    assert candidate(10**30) == 1\n"
            "    assert candidate(987654321) == 45\n"
        ),
    },
    {
        "task_id": "plait/16",
        "entry_point": "chunk",
        "prompt": (
            "def chunk(items: list, size: int) -> list[list]:\n"
            '    """Split `items` into consecutive lists of `size` elements (the last may '
            "be shorter).\n"
            "    >>> chunk([1, 2, 3, 4, 5], 2)\n"
            "    [[1, 2], [3, 4], [5]]\n"
            '    """\n'
        ),
        "canonical_solution": (
            "    return [items[i:i + size] for i in range(0, len(items), size)]\n"
        ),
        "test": (
            "def check(candidate):\n"
            "    assert candidate([], 3) == []\n"
            "    assert candidate([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]\n"
            "    assert candidate([1, 2, 3], 3) == [[1, 2, 3]]\n"
            "    assert candidate([1, 2, 3], 5) == [[1, 2, 3]]\n"
            "    assert candidate(list('abcdef'), 1) == [[c] for c in 'abcdef']\n"
        ),
    },
    {
        "task_id": "plait/17",
        "entry_point": "anagram_groups",
        "prompt": (
            "def anagram_groups(words: list[str]) -> list[list[str]]:\n"
            '    """Group words that are anagrams of each other. Each group keeps the '
            "input order, and groups\n"
            "    are ordered by their first word's position in the input.\n"
            '    >>> anagram_groups(["eat", "tea", "tan", "ate", "nat", "bat"])\n'
            "    [['eat', 'tea', 'ate'], ['tan', 'nat'], ['bat']]\n"
            '    """\n'
        ),
        "canonical_solution": (
            "    groups: dict[str, list[str]] = {}\n"
            "    for word in words:\n"
            "        groups.setdefault(''.join(sorted(word)), []).append(word)\n"
            "    return list(groups.values())\n"
        ),
        "test": (
            "def check(candidate):\n"
            "    assert candidate([]) == []\n"
            "    assert candidate(['eat', 'tea', 'tan', 'ate', 'nat', 'bat']) == [['eat', "
            "'tea', 'ate'], ['tan', 'nat'], ['bat']]\n"
            "    assert candidate(['a']) == [['a']]\n"
            "    assert candidate(['ab', 'cd', 'ba']) == [['ab', 'ba'], ['cd']]\n"
        ),
    },
    {
        "task_id": "plait/18",
        "entry_point": "fibonacci",
        "prompt": (
            "def fibonacci(n: int) -> int:\n"
            '    """The n-th Fibonacci number, with fibonacci(0) == 0 and fibonacci(1) == '
            "1; fast for n up to 10**4.\n"
            "    >>> fibonacci(10)\n"
            "    55\n"
            '    """\n'
        ),
        "canonical_solution": (
            "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
        ),
        "test": (
            "def check(candidate):\n"
            "    assert candidate(0) == 0\n"
            "    assert candidate(1) == 1\n"
            "    assert candidate(2) == 1\n"
            "    assert candidate(10) == 55\n"
            "    assert candidate(90) == 2880067194370816120\n"
            "    assert candidate(10**4) % 1000000007 == 271496360\n"
        ),
    },
    {
        "task_id": "plait/19",
        "entry_point": "most_common_char",
        "prompt": (
            "def most_common_char(text: str) -> str:\n"
            '    """The most frequent character of the non-empty `text`; ties go to the '
            "character that appears\n"
            "    first.\n"
            '    >>> most_common_char("abracadabra")\n'
            "    'a'\n"
            '    """\n'
        ),
        "canonical_solution": (
            "    counts: dict[str, int] = {}\n"
            "    for c in text:\n"
            "        counts[c] = counts.get(c, 0) + 1\n"
            "    best = max(counts.values())\n"
            "    return next(c for c in text if counts[c] == best)\n"
        ),
        "test": (
            "def check(candidate):\n"
            "    assert candidate('a') == 'a'\n"
            "    assert candidate('abracadabra') == 'a'\n"
            "    assert candidate('abcabc') == 'a'\n"
            "    assert candidate('xyzzy') in 'yz' and candidate('xyzzy') == 'y'\n"
            "    assert candidate('  x') == ' '\n"
        ),
    },
]
