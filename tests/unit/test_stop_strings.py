"""engine.tokenizer.StopStrings (an Aho-Corasick matcher with per-request state) against a
naive reference that tries every stop string at every position (str.find / str.endswith),
on random texts fed in random pieces: the same stop, at the same place, the same held-back
tail at every stream boundary; and its cost per character does not grow with the number of
stop strings (counted in automaton steps, not measured in time)."""
import random

from engine.output_processor import OutputProcessor
from engine.sampling_params import SamplingParams
from engine.tokenizer import StopStrings


def naive_find(text: str, stops: list[str], new_len: int) -> tuple[int, str] | None:
    """The earliest-beginning stop string that ends in the last `new_len` characters (ties:
    the first listed)."""
    best = None
    for index, stop in enumerate(stops):
        i = text.find(stop, max(0, len(text) - new_len - len(stop) + 1))
        if i != -1 and (best is None or (i, index) < best):
            best = (i, index)
    return None if best is None else (best[0], stops[best[1]])


def naive_held(text: str, stops: list[str]) -> int:
    """The longest suffix of `text` that is a proper prefix of some stop string."""
    return max((n for s in stops for n in range(1, min(len(text), len(s) - 1) + 1)
                if text.endswith(s[:n])), default=0)


class CharTok:
    """One character per token id (its code point): a tokenizer for OutputProcessor tests."""
    eos_token_ids: set[int] = set()

    def decode_raw(self, ids, skip=True):
        return "".join(chr(i) for i in ids)


def test_against_the_naive_reference_on_random_strings():
    rng = random.Random(0)
    found_some = held_some = 0
    for trial in range(600):
        alphabet = "ab" if trial % 2 else "abcé🤖"      # small alphabets: many overlaps
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))
                 for _ in range(rng.randint(1, 5))]
        if trial % 5 == 0:
            stops.append(stops[0])                        # duplicates, and prefixes of each other
            stops.append(stops[0][:max(1, len(stops[0]) - 2)])
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        m, fed = StopStrings(stops), 0
        while fed < len(text):
            piece = text[fed:fed + rng.randint(1, 4)]
            fed += len(piece)
            got, want = m.feed(piece), naive_find(text[:fed], stops, len(piece))
            assert got == want, (stops, text[:fed], piece)
            assert m.held() == naive_held(text[:fed], stops), (stops, text[:fed])
            found_some += got is not None
            held_some += m.held() > 0
            if got is not None:
                break                                     # a request ends at its first stop
    assert found_some > 100 and held_some > 100


def test_min_tokens_defers_matching_not_the_matcher_state():
    """Text before min_tokens goes through the matcher (a stop string that begins before
    min_tokens and ends after is found) but a stop string ending in it does not count."""
    def run(stop, min_tokens):
        proc = OutputProcessor(CharTok(), [ord("x")], SamplingParams(
            max_tokens=None, stop=[stop], min_tokens=min_tokens))
        sent = "".join(proc.add([ord(c)]).text for c in "axyxyz" if not proc.finished)
        return sent, proc.stop_reason
    assert run("xy", 0) == ("a", "xy")
    assert run("xy", 4) == ("axy", "xy")        # "xy" ending at token 3 is too early
    assert run("yx", 4) == ("ax", "yx")         # tokens 3-4: begins before min_tokens


def test_cost_per_character_does_not_depend_on_the_stop_strings():
    """16 stop strings of 1 kB that almost match all the time (the worst case for the naive
    matcher: every position is a long partial match) cost as many steps per character as
    one short stop string: at most 2 amortized, whatever the list."""
    text = ("a" * 1500 + "c") * 4
    one = StopStrings(["zz"])
    many = StopStrings(["a" * (1023 - k) + "b" + "a" * k for k in range(16)])
    rng = random.Random(1)
    fed = 0
    while fed < len(text):
        piece = text[fed:fed + rng.randint(1, 3)]
        fed += len(piece)
        assert one.feed(piece) is None and many.feed(piece) is None
    assert one.steps <= 2 * len(text) and many.steps <= 2 * len(text)
    assert many.held() == 0 and one.held() == 0


def test_output_processor_holds_and_cuts_like_the_reference():
    """Through OutputProcessor with a character-level stand-in tokenizer: the text a stream
    sends never contains a held-back partial stop and is cut where the reference says."""
    rng = random.Random(2)
    for _ in range(200):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(2, 5))) for _ in range(3)]
        text = "".join(rng.choice("ab") for _ in range(30))
        proc = OutputProcessor(CharTok(), [ord("x")], SamplingParams(max_tokens=None, stop=stops))
        sent = ""
        for k, ch in enumerate(text):
            d = proc.add([ord(ch)])
            sent += d.text
            if proc.finished:
                at, stop = naive_find(text[:k + 1], stops, 1)
                assert sent == text[:at] and proc.stop_reason == stop
                break
            assert sent == text[:k + 1][:k + 1 - naive_held(text[:k + 1], stops)]
        else:
            assert naive_find(text, stops, len(text)) is None


def test_prepare_builds_the_automaton_a_later_matcher_reuses():
    """The gateway builds a stop list's automaton in a worker thread (StopStrings.prepare);
    the matcher its output processor makes afterwards must not build it again."""
    from engine.tokenizer import _automaton
    stops = [f"{i:04d}" + "x" * 1000 for i in range(16)]
    StopStrings.prepare(stops)
    before = _automaton.cache_info()
    m = StopStrings(stops)
    after = _automaton.cache_info()
    assert after.misses == before.misses and after.hits == before.hits + 1
    assert m.feed("0003" + "x" * 1000) == (0, stops[3])
