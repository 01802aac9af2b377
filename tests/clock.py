"""A clock for the tests of rules that take one (rates, deadlines): it moves only when a test moves it."""


class ManualClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
