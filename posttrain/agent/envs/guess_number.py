"""Guess the number: a `step` text game. The model says a number each turn and hears "higher", "lower" or
"correct"; reward 1 on the turn it guesses right (so the summed per-turn reward is 1 for a win), the game
ends then or after `max_guesses` turns."""

from __future__ import annotations

import random
import re


class GuessNumber:
    """Records: `{"secret": int}` or `{"seed": int}` (a secret drawn from 1..100); optional `max_guesses`."""

    def reset(self, record: dict) -> str:
        seed = record.get("seed", 0)
        self.secret = int(record["secret"]) if "secret" in record else random.Random(seed).randint(1, 100)
        self.left = int(record.get("max_guesses", 7))
        return "I am thinking of a whole number from 1 to 100. Guess it: answer with one number per turn."

    def step(self, text: str) -> tuple[str | None, float, bool]:
        numbers = re.findall(r"-?\d+", text)
        self.left -= 1
        if not numbers:
            return "Please answer with a number.", 0.0, self.left <= 0
        guess = int(numbers[-1])
        if guess == self.secret:
            return None, 1.0, True
        return ("higher" if guess < self.secret else "lower"), 0.0, self.left <= 0
