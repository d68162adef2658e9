"""Text and chat examples for scripts/train_demo.py (issue 7).

Training text: Python sources under a root folder (one top-level package = one domain; a few
packages held out for evaluation) plus the prose of `.corpus/*.xz` (scripts/fetch_corpus.sh).
"""

from __future__ import annotations

import lzma
from pathlib import Path


def gather_sources(root: Path, holdout: set[str], max_bytes: int, max_file_bytes: int = 1 << 20
                   ) -> tuple[list[str], list[str]]:
    """(train, eval) file texts from the *.py files under root, in sorted path order.

    A file belongs to eval when its top-level folder (its package) is in `holdout`. Each list
    stops growing past max_bytes; files larger than max_file_bytes (generated tables) are skipped.
    """
    train: list[str] = []
    evals: list[str] = []
    sizes = {"train": 0, "eval": 0}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        # Package = first path component; stray top-level modules go by their stem.
        pkg = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        split = "eval" if pkg in holdout else "train"
        if sizes[split] >= max_bytes:
            continue
        try:
            if path.stat().st_size > max_file_bytes:
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        (evals if split == "eval" else train).append(text)
        sizes[split] += len(text)
    return train, evals


def gather_prose(corpus: Path, max_bytes: int, chunk: int = 1 << 16) -> list[str]:
    """The *.xz files of corpus, cut into ~64 KiB documents, at most max_bytes of each file."""
    docs: list[str] = []
    for path in sorted(corpus.glob("*.xz")) if corpus.is_dir() else []:
        with lzma.open(path, "rt", encoding="utf-8", errors="replace") as f:
            text = f.read(max_bytes)
        docs.extend(text[i:i + chunk] for i in range(0, len(text), chunk))
    return docs


# Built-in ChatML fine-tuning set: short code-flavoured questions and answers.
CHAT_EXAMPLES: list[tuple[str, str]] = [
    ("How do I reverse a list in Python?",
     "Use slicing or the reverse method:\n\n```python\nitems = [1, 2, 3]\n"
     "backwards = items[::-1]\nitems.reverse()\n```"),
    ("Write a function that adds two numbers.",
     "```python\ndef add(a, b):\n    return a + b\n```"),
    ("How do I read a file line by line?",
     "```python\nwith open(path, encoding=\"utf-8\") as f:\n    for line in f:\n"
     "        print(line.rstrip())\n```"),
    ("What is a dictionary in Python?",
     "A dictionary maps keys to values:\n\n```python\nages = {\"alice\": 31, \"bob\": 27}\n"
     "print(ages[\"alice\"])\n```"),
    ("How do I sort a list of numbers?",
     "Use sorted, which returns a new list:\n\n```python\nnumbers = [3, 1, 2]\n"
     "print(sorted(numbers))\n```"),
    ("How can I check if a key is in a dict?",
     "Use the in operator:\n\n```python\nif \"name\" in config:\n    print(config[\"name\"])\n```"),
    ("Write a function that returns the maximum of a list.",
     "```python\ndef maximum(values):\n    best = values[0]\n    for v in values[1:]:\n"
     "        if v > best:\n            best = v\n    return best\n```"),
    ("How do I write JSON to a file?",
     "```python\nimport json\n\nwith open(\"data.json\", \"w\") as f:\n"
     "    json.dump(data, f, indent=2)\n```"),
    ("How do I loop over a list with indexes?",
     "Use enumerate:\n\n```python\nfor i, item in enumerate(items):\n    print(i, item)\n```"),
    ("What does a list comprehension look like?",
     "```python\nsquares = [x * x for x in range(10)]\n```"),
    ("How do I define a class in Python?",
     "```python\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
     "        self.y = y\n```"),
    ("How do I count words in a string?",
     "Split the string and count the parts:\n\n```python\ncount = len(text.split())\n```"),
    ("How do I join a list of strings?",
     "```python\nline = \", \".join([\"a\", \"b\", \"c\"])\n```"),
    ("How do I catch an exception?",
     "Use try and except:\n\n```python\ntry:\n    value = int(text)\nexcept ValueError:\n"
     "    value = 0\n```"),
    ("Write a function that checks if a number is even.",
     "```python\ndef is_even(n):\n    return n % 2 == 0\n```"),
    ("How do I get the length of a string?",
     "Use len:\n\n```python\nsize = len(\"hello\")\n```"),
    ("How do I import the math module?",
     "```python\nimport math\n\nprint(math.sqrt(16))\n```"),
    ("How do I make a copy of a list?",
     "```python\ncopy = list(items)\n# or\ncopy = items[:]\n```"),
    ("Write a function that computes a factorial.",
     "```python\ndef factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n"
     "        result *= i\n    return result\n```"),
    ("How do I remove duplicates from a list?",
     "Convert it to a dict to keep the order:\n\n```python\n"
     "unique = list(dict.fromkeys(items))\n```"),
    ("What is a tuple?",
     "A tuple is an immutable sequence:\n\n```python\npoint = (3, 4)\nx, y = point\n```"),
    ("How do I format a number with two decimals?",
     "Use an f-string:\n\n```python\nprint(f\"{value:.2f}\")\n```"),
    ("How do I get the current directory?",
     "```python\nimport os\n\nprint(os.getcwd())\n```"),
    ("How do I list the files in a folder?",
     "```python\nfrom pathlib import Path\n\nfor path in Path(\".\").iterdir():\n"
     "    print(path.name)\n```"),
    ("Write a function that reverses a string.",
     "```python\ndef reverse(text):\n    return text[::-1]\n```"),
    ("How do I convert a string to an integer?",
     "Use int:\n\n```python\nnumber = int(\"42\")\n```"),
    ("How do I sum the numbers in a list?",
     "```python\ntotal = sum([1, 2, 3])\n```"),
    ("What is a generator?",
     "A function that yields values one at a time:\n\n```python\ndef count_up(n):\n"
     "    for i in range(n):\n        yield i\n```"),
    ("How do I merge two dictionaries?",
     "```python\nmerged = {**first, **second}\n# or, in Python 3.9+\nmerged = first | second\n```"),
    ("Hello!", "Hello! Ask me a question about Python and I will answer with code."),
    ("Who are you?", "I am a small demo model trained for ftchat. I know a little Python."),
    ("What can you do?",
     "I can answer short questions about Python, for example how to sort a list:\n\n"
     "```python\nprint(sorted([3, 1, 2]))\n```"),
]
